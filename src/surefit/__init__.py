"""surefit: fine-tune language models and PyTorch models without the classic data-pipeline bugs.

Python API::

    import surefit
    result = surefit.train(task="sft", data="train.jsonl", epochs=2, lora_r=16)
    result.metrics[-1]["eval_f1"]
"""

from surefit.errors import ConfigError, DataError, Problem, SurefitError

__version__ = "0.1.0"
__all__ = ["train", "evaluate", "predict", "export", "UseOptions", "ConfigError", "DataError", "Problem",
           "SurefitError", "__version__"]


def __getattr__(name: str) -> type:
    """``surefit.UseOptions``, imported on first use so that `import surefit` stays fast."""
    if name == "UseOptions":
        from surefit.api.use_run import UseOptions

        return UseOptions
    raise AttributeError(f"module 'surefit' has no attribute {name!r}")


def train(config=None, /, **settings):  # noqa: ANN001 - re-exported, documented in surefit.api.train
    """Train a model; see :func:`surefit.api.train`. Imported lazily so `import surefit` stays fast."""
    from surefit.threads import configure_threads

    configure_threads()  # before torch loads OpenMP, when this is the first import of torch (threads.py)
    from surefit.api import train as _train

    return _train(config, **settings)


def evaluate(run, data=None, **options):  # noqa: ANN001, ANN201 - documented in surefit.api.evaluate
    """Evaluate a finished run (its validation split, or ``data``); see :func:`surefit.api.evaluate` (its rarely
    changed settings: ``options=surefit.UseOptions(...)``)."""
    from surefit.api import evaluate as _evaluate

    return _evaluate(run, data, **options)


def predict(run, inputs=None, file=None, **options):  # noqa: ANN001, ANN201 - documented in surefit.api.predict
    """Predict with a finished sft or classify run; see :func:`surefit.api.predict` (its rarely changed settings:
    ``options=surefit.UseOptions(...)``)."""
    from surefit.api import predict as _predict

    return _predict(run, inputs, file, **options)


def export(run, to, **options):  # noqa: ANN001, ANN201 - documented in surefit.api.export
    """Export a run's model (``merge=True`` folds a LoRA adapter in); see :func:`surefit.api.export`."""
    from surefit.api import export as _export

    return _export(run, to, **options)
