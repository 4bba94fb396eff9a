"""Find and load models (a local Hugging Face folder, a hub id, a GGUF file or folder, or the embedded default), set
up LoRA on them, and load user model factories (only when the user names one). The embedded models and the GGUF
conversion (once, to a cached folder) are in ``models/gguf.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from surefit.config import TrainConfig
from surefit.errors import ConfigError, ModelError, Problem
from surefit.models.gguf import (
    EMBEDDED_ENCODER_NAME,
    EMBEDDED_LM_NAME,
    embedded_encoder_path,
    embedded_lm_path,
    gguf_to_folder,
)
from surefit.models.lowbit import import_peft, load_in_dtype, load_quantized, norms_in_fp32


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
            model = load_quantized(path, quantize, want, trust_remote_code)
        elif want == torch.float32:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
        else:
            model = load_in_dtype(path, want, trust_remote_code, say)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _load_error(source, e) from e
    if want != torch.float32:
        norms_in_fp32(model)
    return model


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


def plain_lora_adapter(layer: Any, quantized_base: bool = False) -> str | None:
    """The one active adapter of a peft LoRA layer when the layer computes a plain ``W x + scale * B(A(x))``: not
    merged, not DoRA, no adapter bias, plain ``Linear`` base, A and B; None otherwise. The fused training forward
    and merged generation both rely on exactly that, so both ask here. ``quantized_base``: a bitsandbytes 4-bit or
    8-bit base layer counts as plain too (the fused training forward calls it as a module; generation does not)."""
    import torch

    if layer.disable_adapters or layer.merged:
        return None
    active = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "lora_bias", {}).get(name, False):
        return None
    if any(type(m) is not torch.nn.Linear for m in (layer.lora_A[name], layer.lora_B[name])):
        return None
    base = type(layer.base_layer)
    if base is not torch.nn.Linear and not (quantized_base and base.__module__.startswith("bitsandbytes.")
                                            and base.__name__ in ("Linear4bit", "Linear8bitLt")):
        return None
    return name


def _refused_by_peft(model: Any, lora: Any, names: set[str]) -> set[str]:
    """Those of ``names`` peft's architecture check refuses as LoRA targets on ``model`` (a Mamba mixer's
    ``out_proj`` on Falcon-H1, Mamba 2, Nemotron-H). peft expands ``all-linear`` into them and then raises part-way
    through changing the model, so surefit asks the same check first. Empty where peft has no such check."""
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:
        return set()
    refused = set()
    for name in names:
        try:
            check(lora, model, name)
        except ValueError:
            refused.add(name)
    return refused


def _parameter_targets(model: Any, lora: Any) -> set[str]:
    """The parameters (not modules) peft will adapt for ``lora`` on ``model``: transformers 5 stores an MoE layer's
    experts as fused 3-D parameters, and peft maps module targets (``all-linear`` included) onto them. Read from
    peft's own conversion, run on a copy of the config (the model is only read); empty where peft has none."""
    import copy

    probe = copy.deepcopy(lora)
    try:
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )

        convert_peft_config_for_transformers(probe, model=model, conversions=get_model_conversion_mapping(model))
    except (ImportError, AttributeError, TypeError, ValueError):  # another peft: only what was asked for
        pass
    return set(getattr(probe, "target_parameters", None) or [])


def apply_lora(model: Any, cfg: TrainConfig, task_type: str | None, say=print, note: str = "", part: str | None = None) -> Any:
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
    peft = import_peft()
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model  # noqa: N806

    variant = getattr(cfg, "lora_variant", "lora")
    extra: dict[str, Any] = {"task_type": task_type} if task_type else {}
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.resolved_lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_targets), use_dora=variant == "dora",
                      use_rslora=variant == "rslora", **extra)
    target = getattr(model, part) if part else model
    fused_experts = sorted(_parameter_targets(target, lora))
    if fused_experts and cfg.lora_dropout:
        # peft adapts transformers 5's fused MoE experts (3-D parameters) through ParamWrapper, which refuses any
        # dropout (and raises after it has already changed the model): build without, then give the linear layers'
        # adapters the dropout asked for.
        import dataclasses

        lora = dataclasses.replace(lora, lora_dropout=0.0)
    import torch

    if cfg.lora_targets == "all-linear":
        head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        linear = {n.rsplit(".", 1)[-1] for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)
                  and m is not head}
        refused = _refused_by_peft(target, lora, linear)
        if refused and linear - refused:
            import dataclasses

            kept = sorted(linear - refused)
            lora = dataclasses.replace(lora, target_modules=kept)
            say(f"--lora_targets all-linear: not on {', '.join(sorted(refused))}, which peft cannot adapt on a "
                f"{getattr(target.config, 'model_type', '?')} model (a Mamba mixer's); on the other linear layers "
                f"({', '.join(kept)}; the saved adapter_config.json names them)")
    try:
        wrapped = get_peft_model(target, lora)
    except ValueError as e:
        raise ConfigError(
            Problem(f"cannot apply LoRA: {e}", "--lora_targets", "use 'all-linear' or names of Linear modules")
        ) from e
    if fused_experts and cfg.lora_dropout:
        with_dropout = 0
        for layer in wrapped.modules():
            drop = getattr(layer, "lora_dropout", None)
            if isinstance(drop, torch.nn.ModuleDict) and type(layer).__name__ != "ParamWrapper":
                for name in list(drop.keys()):
                    drop[name] = torch.nn.Dropout(p=cfg.lora_dropout)
                    with_dropout += 1
        say(f"--lora_dropout {cfg.lora_dropout}: on the adapters of the {with_dropout} linear layers; the fused MoE "
            f"parameters ({', '.join(fused_experts)}) are adapted through peft's parameter LoRA, which takes no "
            "dropout (the saved adapter_config.json says lora_dropout 0.0 for that reason; --lora_dropout 0 for none "
            "anywhere)")
    if part:
        setattr(model, part, wrapped)
    else:
        model = wrapped
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    applied: Any = wrapped.peft_config["default"]  # a LoraConfig; peft types it as its base class
    adapted = sorted({n.split(".")[-1] for n in applied.target_modules or []})
    adapted += [f"{n} (parameter)" for n in sorted(applied.target_parameters or [])]
    kind = {"lora": "LoRA", "dora": "DoRA", "rslora": "rsLoRA"}[variant]
    scale = f" (scaling alpha/sqrt(r) = {cfg.resolved_lora_alpha / cfg.lora_r ** 0.5:.3g})" if variant == "rslora" else ""
    say(f"{kind} r={cfg.lora_r} alpha={cfg.resolved_lora_alpha}{scale} on {', '.join(adapted)}: {trainable:,} trainable "
        f"of {total:,} parameters ({100.0 * trainable / total:.2f}%{note})")
    if variant == "dora":
        say("DoRA trains through peft's own layer forward: surefit's fused LoRA forward (fp32 sum under bf16, cheap "
            "dropout) does not cover it")
    return model


# ------------------------------------------------------------------------------------------------------------ factories


def import_user_module(target: str, prefix: str = "surefit_user_") -> Any:
    """Import the module a user named on this command line: ``path/to/file.py`` by its path, or ``package.module``
    as Python would, with the working directory on the lookup path for this import only (``python -m`` and
    ``python script.py`` look there too, so ``--metric mymetric:score`` finds ``./mymetric.py``).

    Callers do this only for code named on this command line (or allowed by ``--allow_code``).
    """
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path} (relative to {os.getcwd()})")
        mod_name = prefix + re.sub(r"\W", "_", path.stem)
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module  # dataclasses, pickling and DataLoader workers look the module up by name
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        importlib.invalidate_caches()  # a module written since start-up is found too
        return importlib.import_module(target)
    finally:
        if added:
            sys.path.remove(cwd)


def load_factory(spec: str, flag: str = "--head") -> Any:
    """Resolve ``module:Name`` or ``file.py:Name`` to the object it names; problems name ``flag``.

    This imports (runs) the user's module, exactly as ``import`` would: callers do it only for a factory the user
    named on this command line (``--head``, ``--model`` of a custom run, ``--data module:make``).
    """
    target, _, name = spec.rpartition(":")
    try:
        module = import_user_module(target)
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
