"""vramplan's cost model: the bytes a Transformer training or inference step holds per GPU.

>>> import calc
>>> model = calc.load_card("qwen2.5-32b")
>>> # or by Hugging Face id (config.json only): calc.from_pretrained("Qwen/Qwen3-32B")
>>> job = calc.Training(micro_batch=1, seq_len=2048, precision="bf16", optimizer="adamw")
>>> est = calc.estimate(model, job)  # doctest: +SKIP

``with calc.reporting(callback):`` calls ``callback(calc.Progress(...))`` as a first estimate
records transformers' code (seconds to minutes; then the disk cache answers).

``calc.plan`` is the capacity planner (``calc.plan.planner.plan``, ``evaluate``,
``least_hardware``, ``changes_to_fit``).
"""

import calc.plan.planner  # noqa: F401 (the README's calc.plan.planner.plan(...))
from calc import plan
from calc.compress.sparse import storage_verdict
from calc.compress.structured import pruned_spec
from calc.config.compression import LoRA, Quant
from calc.config.distill import Distill
from calc.config.jobs import Inference, Sampling, Training
from calc.config.model_spec import ModelSpec, ParamTensor
from calc.config.parallelism import Parallelism
from calc.config.pruning import Pruning
from calc.config.serving import Serving
from calc.data.cards import list_cards, load_card, load_card_config, published_params
from calc.data.hub import HubConfig, from_pretrained, load_hub_config
from calc.derive.progress import Progress, reporting
from calc.derive.replay import RecorderMissing, param_count
from calc.estimate.api import estimate
from calc.estimate.result import Estimate
from calc.serving.api import ServeEstimate, serve
from calc.units import GIB

__all__ = [
    "GIB",
    "Distill",
    "Estimate",
    "HubConfig",
    "Inference",
    "LoRA",
    "ModelSpec",
    "Parallelism",
    "ParamTensor",
    "Progress",
    "Pruning",
    "Quant",
    "RecorderMissing",
    "Sampling",
    "ServeEstimate",
    "Serving",
    "Training",
    "estimate",
    "from_pretrained",
    "list_cards",
    "load_card",
    "load_card_config",
    "load_hub_config",
    "param_count",
    "plan",
    "pruned_spec",
    "published_params",
    "reporting",
    "serve",
    "storage_verdict",
]
