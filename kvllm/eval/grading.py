"""Math grading by math-verify: the completion's final ``\\boxed{}`` answer against the gold one.

``0.5``, ``\\frac{1}{2}`` and ``\\frac{2}{4}`` all match ``1/2``. Its own module, below
both :mod:`kvllm.eval.problems` (which grades with it) and :mod:`kvllm.eval.math_data`
(which loads the problems), so the imports run one way.
"""

from __future__ import annotations

from math_verify import LatexExtractionConfig, parse, verify

# Only boxed answers count: a number merely mentioned in the reasoning is not an answer.
_BOXED_ONLY = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]


def grade_math(gold: str, completion: str) -> bool:
    """Whether the completion's last ``\\boxed{}`` answer equals ``gold`` (math-verify)."""
    gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$")
    # math-verify merges nearby boxed answers into a set; only the last one counts here.
    last = completion.rfind("\\boxed")
    if last < 0:
        return False
    answer = parse(completion[last:], extraction_config=_BOXED_ONLY)
    return bool(gold_parsed) and bool(answer) and verify(gold_parsed, answer)
