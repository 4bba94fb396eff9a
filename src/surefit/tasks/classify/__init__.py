"""Sequence classification (``surefit train --task classify``).

``train_classify.py`` trains: data -> labels -> model -> loop -> ``final/``, top to bottom. ``use_classify.py`` uses
a finished run: ``load``, ``evaluate``, ``predict``, ``export``. Together they expose the surface every task has
(docs/architecture.md).
"""

from surefit.tasks.classify.train_classify import (
    FIELDS,
    HF_PROBLEM_TYPES,
    build_model,
    final_files,
    load_data,
    predict_logits,
    prepare,
    run,
    save,
)
from surefit.tasks.classify.use_classify import evaluate, export, label_spec, load, predict

__all__ = ["FIELDS", "HF_PROBLEM_TYPES", "build_model", "evaluate", "export", "final_files", "label_spec", "load",
           "load_data", "predict", "predict_logits", "prepare", "run", "save"]
