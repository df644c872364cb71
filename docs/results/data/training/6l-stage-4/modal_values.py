"""How much of a chain's lookup fidelity a constant writer gets for free.

Per Full-KV free cell of a ``kvllm eval`` results.jsonl: the share of the chains' written
results that equal each chain's most common one, and the share of operand reads (prompt
reads included) whose digits are that value.

Usage: ``python modal_values.py MODEL RESULTS.jsonl [RESULTS.jsonl ...]``
"""

import collections
import json
import re
import sys

from transformers import AutoTokenizer

RESULT = re.compile(r"= [a-z]{2}(\d\d)\n")
READ = re.compile(r"= [a-z]{2}(\d\d) [+-] [a-z]{2}(\d\d) =")

if __name__ == "__main__":
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    for path in sys.argv[2:]:
        for line in open(path):
            cell = json.loads(line)
            if cell["retention"] != 1.0 or cell["mode"] != "free":
                continue
            results = modal_results = reads = modal_reads = 0
            for problem in cell["problems"]:
                text = tok.decode(problem["ids"])
                values = RESULT.findall(text)
                if not values:
                    continue
                mode, n = collections.Counter(values).most_common(1)[0]
                results += len(values)
                modal_results += n
                for a, b in READ.findall(text):
                    reads += 2
                    modal_reads += (a == mode) + (b == mode)
            print(
                f"{path}: {cell['family']}: modal result share {modal_results / max(results, 1):.3f} of {results}; "
                f"reads of the modal value {modal_reads / max(reads, 1):.3f} of {reads}"
            )
