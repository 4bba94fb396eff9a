"""Frozen weights in fewer bits: read straight into 16 bits tensor by tensor (no fp32 copy of the model at any
moment), or quantised to 4 or 8 bits through bitsandbytes (QLoRA). ``models.load_causal_lm`` calls these.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from surefit.errors import ConfigError, Problem

QUANTIZE_INSTALL = "pip install 'surefit[quantize]'"


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


# True while import_peft keeps bitsandbytes hidden (None in sys.modules); require_bitsandbytes brings it back.
_HIDDEN_BNB: list[bool] = []


def import_peft() -> Any:
    """``import peft``, without bitsandbytes unless a quantised model was loaded.

    peft imports bitsandbytes whenever it is installed (``peft.helpers``, and its layer dispatch at every
    ``get_peft_model``). That costs about a second of every start (bitsandbytes pulls in torch's compiler), and a
    bitsandbytes installed but unable to load (no backend for this machine) would break every LoRA command with its
    traceback. A quantised model is only ever loaded through :func:`require_bitsandbytes`, which imports it first;
    when it is not imported yet, no layer of any model here can be a bitsandbytes layer, so it is hidden from peft (as
    if not installed) until :func:`require_bitsandbytes` needs it.
    """
    import sys

    if "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
        _HIDDEN_BNB.append(True)
    import peft

    return peft


def reveal_bitsandbytes() -> None:
    """Undo :func:`import_peft`'s hiding (only its own: a ``None`` someone else put there stays)."""
    import sys

    if _HIDDEN_BNB and "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
        del sys.modules["bitsandbytes"]
    _HIDDEN_BNB.clear()


def bitsandbytes_installed() -> bool:
    """Whether a bitsandbytes package is there to import (``None`` in sys.modules says it is not)."""
    import importlib.util

    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        return False


def require_bitsandbytes(quantize: str) -> Any:
    """Import bitsandbytes and check it quantises and multiplies on this machine (a tiny layer, forward only).

    Raises:
        ConfigError: naming what to install, or what the backend said.
    """
    import logging
    import sys
    import warnings

    import torch

    # On a CPU without the optional `kernels` package bitsandbytes logs a warning at import and uses its own kernel.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    reveal_bitsandbytes()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 - not installed (ImportError), or installed and broken (OSError ...)
        if not isinstance(e, ImportError) or bitsandbytes_installed():
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise ConfigError(Problem(f"--quantize {quantize} needs bitsandbytes, which is installed but cannot be "
                                      f"loaded on this machine ({why})", "--quantize",
                                      f"reinstall it: {QUANTIZE_INSTALL}")) from e
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
    helpers = sys.modules.get("peft.helpers")
    if helpers is not None and getattr(helpers, "bnb", False) is None:
        # peft imported while bitsandbytes was hidden: its dequantising helpers see it now
        setattr(helpers, "bnb", bnb)  # noqa: B010
    return bnb


def load_quantized(path: str, quantize: str, compute: Any, trust_remote_code: bool) -> Any:
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


def load_in_dtype(path: str, dtype: Any, trust_remote_code: bool, say=print) -> Any:
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
    norms_in_fp32(model)  # before reading too: a norm read into 16 bits would be rounded
    targets = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    stored = {k for _, h, _ in heads for k in h}
    missing = {k for k in targets if k not in stored} - _tied_or_computed(model, stored)
    if stored - targets.keys() or missing or any(v["dtype"] not in _ST_DTYPES for _, h, _ in heads for v in h.values()):
        del model
        say("loading through transformers: the checkpoint's tensor names or dtypes differ from the model's (its "
            "loading may hold an fp32 copy of the weights for a moment)")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    chunk = bytearray(_CHUNK_BYTES)  # one buffer for every read: a new one per piece cost its pages' faults
    with torch.no_grad():
        for file, head, start in heads:
            with open(file, "rb", buffering=0) as fh:
                for name, meta in head.items():
                    _read_into(fh, start, meta, targets[name], chunk)
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


def _read_into(fh: Any, start: int, meta: dict[str, Any], target: Any, chunk: bytearray) -> None:
    """Copy one stored tensor into ``target`` (cast to its dtype), read into ``chunk`` (``_CHUNK_BYTES``) piece by
    piece."""
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
        view, got = memoryview(chunk)[:n * item], 0
        while got < n * item:  # readinto may return less than asked (a pipe, a network file system)
            k = fh.readinto(view[got:])
            if not k:
                raise ValueError(f"the checkpoint ends inside a tensor ({got} of {n * item} bytes read)")
            got += k
        flat[done:done + n].copy_(torch.frombuffer(chunk, dtype=src, count=n))
        done += n
    assert done * item == b - a


def norms_in_fp32(model: Any) -> None:
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
