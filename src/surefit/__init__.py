"""surefit: fine-tune language models and PyTorch models without the classic data-pipeline bugs.

Python API::

    import surefit
    result = surefit.train(task="sft", data="train.jsonl", epochs=2, lora_r=16)
    result.metrics[-1]["eval_f1"]
"""

from surefit.errors import ConfigError, DataError, Problem, SurefitError

__version__ = "0.1.0"
__all__ = ["train", "ConfigError", "DataError", "Problem", "SurefitError", "__version__"]


def train(config=None, /, **settings):  # noqa: ANN001 - re-exported, documented in surefit.api.train
    """Train a model; see :func:`surefit.api.train`. Imported lazily so `import surefit` stays fast."""
    from surefit.api import train as _train

    return _train(config, **settings)
