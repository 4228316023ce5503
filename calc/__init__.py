"""vramplan's cost model: the bytes a Transformer training or inference step holds per GPU.

>>> import calc
>>> model = calc.load_card("qwen2.5-32b")
>>> job = calc.Training(micro_batch=1, seq_len=2048, precision="bf16", optimizer="adamw")
>>> est = calc.estimate(model, job)  # doctest: +SKIP
"""

from calc.compress.sparse import storage_verdict
from calc.compress.structured import pruned_spec
from calc.config.compression import LoRA, Quant
from calc.config.distill import Distill
from calc.config.jobs import Inference, Training
from calc.config.model_spec import ModelSpec, ParamTensor
from calc.config.parallelism import Parallelism, check_divisibility
from calc.config.pruning import Pruning
from calc.data.cards import list_cards, load_card, load_card_config, published_params
from calc.estimate.core import estimate, values_for
from calc.estimate.result import Estimate
from calc.models.attention import attention_kernel
from calc.units import GIB

__all__ = [
    "GIB",
    "Distill",
    "Estimate",
    "Inference",
    "LoRA",
    "ModelSpec",
    "Parallelism",
    "ParamTensor",
    "Pruning",
    "Quant",
    "Training",
    "attention_kernel",
    "check_divisibility",
    "estimate",
    "list_cards",
    "load_card",
    "load_card_config",
    "pruned_spec",
    "published_params",
    "storage_verdict",
    "values_for",
]
