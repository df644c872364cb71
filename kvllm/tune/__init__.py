"""``kvllm tune``: the retention a user can afford, measured on their model and prompts in vLLM.

Full KV writes each prompt's completion first; then candidate settings (methods x
retentions, refined by bisection) write theirs in the same pool at the same
concurrency. Each is graded against a gold answer, or against Full KV's own completion
when there is none (:mod:`kvllm.tune.grade`), and the recommended setting is the one of
least memory whose confidence bounds keep the tolerances (:mod:`kvllm.tune.choose`).
"""

from kvllm.tune.choose import Tolerances, choose
from kvllm.tune.prompts import MIN_PROMPTS, TunePrompt, family_prompts, load_prompts
from kvllm.tune.run import Tune, run_tune

__all__ = [
    "MIN_PROMPTS",
    "Tolerances",
    "Tune",
    "TunePrompt",
    "choose",
    "family_prompts",
    "load_prompts",
    "run_tune",
]
