"""Typed configuration: one dataclass per command, filled from defaults < YAML file < command-line flags.

The CLI is derived from these dataclasses (litgpt ``args.py`` style): each field's ``help`` metadata becomes its
``--help`` text, each field is reachable as ``--lora_r`` and ``--lora-r``. Validation collects every problem and
raises one :class:`~surefit.errors.ConfigError` that names the flags as the user types them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from surefit.config.checks import (
    NONFINITE,
    at_least,
    cache_dir_problems,
    divisors,
    nonfinite_problems,
    output_dir_problems,
    report_to_problems,
    split_names,
    training_control_problems,
)
from surefit.config.yaml_files import load_preset
from surefit.errors import ConfigError, Problem


def opt(default: Any, help: str, **meta: Any) -> Any:  # noqa: A002 - "help" reads best at the call sites
    """A dataclass field whose ``help`` becomes the flag's ``--help`` text."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    """Settings every training task shares. Each task's dataclass adds its own and may change defaults."""

    task: str = opt("sft", "Training path: 'sft' (instruction tuning), 'classify' (sequence classification), 'custom'.")
    preset: str | None = opt(
        None, "A preset name (see surefit/presets/, e.g. gtx1650-4gb, cpu) or a YAML path; applied before --config."
    )
    # -- model
    model: str | None = opt(None, "A local Hugging Face folder, a hub id (where the hub is reachable), or a .gguf file.")
    lora_r: int = opt(16, "LoRA rank; 0 means full fine-tuning.")
    lora_alpha: int | None = opt(None, "LoRA alpha. Default: 2 x lora_r.")
    lora_dropout: float = opt(0.05, "Dropout on the LoRA branch.")
    lora_targets: str = opt(
        "all-linear",
        "Comma-separated module names to adapt, or 'all-linear' (every linear layer of the blocks, not the output head).",
    )
    lora_variant: Literal["lora", "dora", "rslora"] = opt(
        "lora", "'dora': weight-decomposed LoRA (peft use_dora; trains through peft's own forward). 'rslora': "
        "rank-stabilised scaling alpha / sqrt(r) instead of alpha / r (peft use_rslora)."
    )
    quantize: Literal["none", "4bit", "8bit"] = opt(
        "none", "QLoRA: store the frozen base weights quantised by bitsandbytes ('4bit': nf4 with double quantisation; "
        "'8bit': LLM.int8), computing in --precision; the LoRA adapters train in fp32. Needs LoRA (--lora_r > 0) and "
        "`pip install 'surefit[quantize]'`."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = opt(
        "auto", "Compute precision. 'auto': bf16 on GPUs that support it, fp16 on other GPUs; on a CPU bf16 for LoRA "
        "runs when it has AVX-512 BF16 or AMX, else fp32. With LoRA the matmuls use 16 bits, but the adapters' "
        "contribution is summed in fp32 and the adapters train in fp32."
    )
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass: less memory, ~30% slower.")
    sharding: Literal["none", "fsdp"] = opt(
        "none", "With several processes: 'none' (DDP: each process holds the whole model) or 'fsdp' (FSDP2: "
        "parameters, gradients and optimizer states sharded over the processes; each process writes its shard of a "
        "checkpoint, and a run resumes with any number of processes).")
    gpu_memory_gb: str | None = opt(
        None,
        "Memory to fit the run in, in GB, or 'auto' (what the GPU has free). The planner then picks the micro-batch, "
        "accumulation, checkpointing and frozen-weight dtype; --batch_size never changes. Unset: auto on a GPU, the "
        "settings as given on a CPU.",
    )
    trust_remote_code: bool = opt(
        False, "Allow a model folder or hub repo to run its own Python code when loading. Off unless you trust it."
    )
    # -- data
    data: str | None = opt(None, "Training data: JSONL, JSON, CSV, TSV, Parquet, or a saved datasets folder.")
    val_data: str | None = opt(None, "Validation data (same formats). Default: split --val_fraction off --data.")
    val_fraction: float = opt(0.1, "Fraction of --data held out for validation when --val_data is not given.")
    limit: int | None = opt(None, "Use only the first N rows of --data (and of --val_data).")
    max_seq_length: int = opt(512, "Longest sequence in tokens.")
    on_bad_rows: Literal["error", "skip"] = opt(
        "error", "A malformed row stops the run ('error'), or is dropped and written to OUTPUT/rejected_rows.jsonl "
        "('skip'; the count is reported)."
    )
    # -- optimisation
    epochs: int = opt(3, "Passes over the training data.")
    batch_size: int = opt(4, "Examples per optimizer step (the effective batch).")
    grad_accum: int = opt(1, "Split each batch into this many micro-batches (batch_size must be divisible by it).")
    lr: float = opt(2e-4, "Peak learning rate (AdamW).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    warmup_ratio: float = opt(0.05, "Fraction of optimizer steps spent warming up (then cosine decay).")
    max_grad_norm: float = opt(1.0, "Gradient clipping norm; 0 disables clipping.")
    seed: int = opt(0, "Seed for the split, augmentation, shuffling and initialisation.")
    eval_batch_size: int | None = opt(None, "Batch size for evaluation. Default: 2 x the micro-batch.")
    # -- output
    output_dir: str = opt("runs/sft", "Where the config, metrics, predictions, checkpoints and final model go.")
    log_every: int = opt(10, "Write a training-loss line to metrics.jsonl every N optimizer steps.")
    report_to: str = opt(
        "none", "Also send the metrics to experiment trackers: 'tensorboard' (event files in OUTPUT/tensorboard), "
        "'wandb', or both comma-separated. metrics.jsonl is always written."
    )
    save_every: int = opt(0, "Also save a checkpoint every N optimizer steps (0: only at each epoch end).")
    keep_checkpoints: int = opt(0, "Keep only the newest K checkpoints (0 keeps every one).")
    resume: str | None = opt(
        None, "Continue the run in --output_dir from its newest usable checkpoint (--resume alone), or from PATH.",
        const="latest",
    )
    overwrite: bool = opt(False, "Replace a previous run in --output_dir (without it, such a run is refused).")
    allow_changed_data: bool = opt(False, "With --resume: continue although the data (or another input file) changed "
                                   "since the run started; the changes are listed and recorded in data_files.json.")
    force: bool = opt(False, "Train even if the doctor reports errors (the run says which errors it overrides).")
    no_cache: bool = opt(False, "Re-run the doctor's dry run, the memory planner's measurements and the evaluation "
                         "before training, and encode the data in memory, instead of reusing those of an identical "
                         "earlier start (model files, data, settings and code unchanged; docs/startup.md).")
    cache_dir: str | None = opt(
        None, "The folder of surefit's caches: converted GGUF models (gguf/) and the start-up cache (startup/: the "
        "doctor's report, the planner's measurements, sft's encoded data). Default: $SUREFIT_CACHE, else "
        "~/.cache/surefit; the flag beats $SUREFIT_CACHE and $SUREFIT_STARTUP_CACHE (docs/startup.md).")
    profile: bool = opt(False, "At the end, print where the run's wall time went (start-up phases, training steps, "
                        "evaluation loss, generation, checkpoints, final save, report) and write it to "
                        "OUTPUT/profile.json (docs/performance.md).")
    on_nonfinite: Literal["stop", "skip_step"] = opt(
        "stop", "A non-finite loss or gradient norm: 'stop' the run there (nothing non-finite is applied or saved; "
        "the last good checkpoint stays), or 'skip_step': skip that optimizer step (each skip is counted and reported)."
    )
    # -- training control (schedule length, scheduler, evaluation, best model)
    max_steps: int | None = opt(None, "Stop after N optimizer steps, overriding --epochs (the schedule is built for "
                                "these N steps; the plan prints how many epochs that is).")
    lr_scheduler: Literal["cosine", "linear", "constant", "wsd"] = opt(
        "cosine", "Learning-rate shape after warmup: cosine or linear decay to --min_lr, constant, or wsd "
        "(warmup-stable-decay: constant, then a linear decay over the last 10 percent of the steps).")
    warmup: float | None = opt(None, "Warmup as optimizer steps (a whole number >= 1) or a ratio of the steps "
                               "(below 1); replaces --warmup_ratio when given.")
    min_lr: float = opt(0.0, "Learning rate the cosine, linear and wsd schedules end at (below --lr).")
    eval_every: int = opt(0, "Also evaluate every N optimizer steps, besides each epoch end (0: epoch ends only).")
    early_stopping: str | None = opt(
        None, "METRIC:PATIENCE, e.g. eval_loss:3 or eval_f1:2: stop when METRIC has not improved for PATIENCE "
        "evaluations in a row (lower is better for losses, higher for f1, accuracy, exact match).")
    keep_best: str | None = opt(
        None, "METRIC (e.g. eval_f1): keep the checkpoint of the best evaluation whatever --keep_checkpoints says, "
        "and save that model as final/ (default: final/ is the last state). --early_stopping implies it.")
    log_samples: int = opt(0, "At each evaluation, log the first N validation rows' prompt, reference and "
                           "prediction (predictions/samples/, TensorBoard text, the HTML report); sft and classify.")

    # Why a task cannot quantise its base (None: it can, with LoRA).
    quantize_refused: ClassVar[str | None] = None

    def problems(self) -> list[Problem]:
        """Every cross-field and range problem, naming the flag as the user types it."""
        p: list[Problem] = []
        for name in ("epochs", "batch_size", "grad_accum", "log_every", "limit", "eval_batch_size", "lora_alpha"):
            at_least(p, self, name, 1)
        at_least(p, self, "max_seq_length", 8)
        at_least(p, self, "lora_r", 0)
        at_least(p, self, "keep_checkpoints", 0)
        at_least(p, self, "save_every", 0)
        if self.resume and self.overwrite:
            p.append(Problem("--resume and --overwrite both given", "--overwrite", "use one: continue the run, or replace it"))
        p += nonfinite_problems(self)
        if math.isfinite(self.val_fraction) and not 0.0 <= self.val_fraction < 1.0:
            p.append(Problem(f"must be in [0, 1) (got {self.val_fraction})", "--val_fraction", "e.g. --val_fraction 0.1"))
        if self.lr <= 0 and math.isfinite(self.lr):
            p.append(Problem(f"must be > 0 (got {self.lr})", "--lr", "e.g. --lr 2e-4"))
        for name in ("weight_decay", "max_grad_norm", "lora_dropout"):
            if getattr(self, name) < 0 and math.isfinite(getattr(self, name)):
                p.append(Problem(f"must be >= 0 (got {getattr(self, name)})", f"--{name}"))
        if math.isfinite(self.warmup_ratio) and not 0.0 <= self.warmup_ratio < 1.0:
            p.append(Problem(f"must be in [0, 1) (got {self.warmup_ratio})", "--warmup_ratio"))
        if self.gpu_memory_gb is not None and str(self.gpu_memory_gb) != "auto":
            try:
                ok = math.isfinite(float(self.gpu_memory_gb)) and float(self.gpu_memory_gb) > 0
            except ValueError:
                ok = False
            if not ok:
                p.append(Problem(f"must be a number of GB above 0 or 'auto' (got {self.gpu_memory_gb!r})",
                                 "--gpu_memory_gb", "e.g. --gpu_memory_gb 3.8 for a 4 GB card, or --gpu_memory_gb auto"))
        if self.batch_size >= 1 and self.grad_accum >= 1 and self.batch_size % self.grad_accum:
            p.append(
                Problem(
                    f"--batch_size {self.batch_size} is not divisible by --grad_accum {self.grad_accum}; "
                    "the effective batch would change",
                    "--grad_accum",
                    f"pick a divisor of {self.batch_size}: {', '.join(map(str, divisors(self.batch_size)))}",
                )
            )
        if self.quantize != "none" and self.quantize_refused:
            p.append(Problem(f"--quantize is not available for --task {self.task} (got --quantize {self.quantize}): "
                             f"{self.quantize_refused}", "--quantize", "drop --quantize"))
        elif self.quantize != "none" and self.lora_r == 0:
            p.append(Problem(f"--quantize {self.quantize} stores the base weights quantised, so they cannot train: it "
                             "needs LoRA adapters (got --lora_r 0)", "--quantize",
                             "pass --lora_r 16 (QLoRA), or drop --quantize for full fine-tuning"))
        p += report_to_problems(self.report_to)
        p += output_dir_problems(self.output_dir)
        p += cache_dir_problems(self.cache_dir)
        if self.data is None:
            p.append(Problem("no training data given", "--data", "pass --data FILE (JSONL, JSON, CSV, TSV, Parquet, ...)"))
        p += training_control_problems(self)
        return p

    @property
    def trackers(self) -> list[str]:
        """The experiment trackers ``--report_to`` names (empty for 'none')."""
        return [t for t in split_names(self.report_to) if t != "none"]

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def resolved_lora_alpha(self) -> int:
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_r

    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or 2 * self.micro_batch_size


@dataclass
class SFTConfig(TrainConfig):
    """Instruction tuning of a causal language model on input -> target rows."""

    task: Literal["sft"] = opt("sft", "Training path. 'sft': instruction tuning of a causal LM.")
    model: str | None = opt(
        None,
        "A local Hugging Face folder, a hub id (where the hub is reachable), or a .gguf file/folder. "
        "Default: the embedded SmolLM2-135M-Instruct.",
    )
    data: str | None = opt(None, "Training data: JSONL, JSON, CSV, TSV, Parquet, a saved datasets folder, or SQuAD JSON.")
    input_field: str = opt("input", "Column holding the input text.")
    target_field: str = opt("target", "Column holding the target text.")
    template: str | None = opt(
        None, "Prompt template naming fields of the rows, e.g. 'Question: {input}\\nAnswer: ' or "
        "'{instruction}\\n\\n{input}' (a paragraph whose fields are all empty is left out). For conversations it "
        "writes the user turn. Default: a plain instruction template, or the model's chat template."
    )
    chat_template: bool | None = opt(
        None, "Format prompts with a chat template: true (the model's own), false (the plain template for "
        "input/target rows), or a built-in name / Jinja file (read as --chat_format; aliases chat_template_path, "
        "chat_template_jinja). Default: the choice is printed with its reason.")
    chat_format: str | None = opt(
        None, "A chat template for a model that ships none (or to replace its own): a built-in name (chatml, llama3, "
        "gemma) or a Jinja file. It is saved with the tokenizer.")
    system_prompt: str = opt(
        "auto", "The system turn of rows that have none, under a chat template. 'auto': what the template does (a "
        "default system prompt it adds is found by rendering and printed with its count); 'none': none (an empty "
        "system turn where the template would add its default); other text: that system turn.")
    format: Literal["auto", "input_target", "prompt_completion", "alpaca", "messages", "sharegpt"] = opt(
        "auto", "Row format. 'auto' detects it from the fields (messages, conversations, instruction/output, "
        "prompt/completion, --input_field/--target_field) and prints the mapping.")
    role_map: str | None = opt(
        None, "ShareGPT speaker names -> roles, e.g. 'bot=assistant,human=user' (added to the known names).")
    train_on: Literal["all_assistant", "last_assistant"] = opt(
        "all_assistant", "Which assistant turns of a conversation carry loss (with the terminator after each).")
    truncation: Literal["drop_oldest", "exclude"] = opt(
        "drop_oldest", "A conversation longer than --max_seq_length: drop its oldest exchanges (the system turn stays) "
        "or exclude it. Either way it is counted and listed; an assistant turn is never cut.")
    thinking: Literal["train_empty", "switch_off"] = opt(
        "train_empty", "A row without reasoning, on a template that writes an empty think block before the answer: "
        "'train_empty' trains the block with the answer (the model learns to answer without thinking unprompted); "
        "'switch_off' renders such rows with the template's thinking switch off (enable_thinking=False), so the "
        "block is in the prompt, and predict/eval prompt with thinking off. The choice and its count are printed.")
    system_turn: Literal["fold", "refuse"] = opt(
        "fold", "A system turn on a template that rejects the system role (Gemma 1/2): 'fold' writes its text at the "
        "start of the first user turn (counted and printed); 'refuse' reports the template's error.")
    metric: str = opt(
        "auto", "Scores of the generated answers: 'squad' (token F1 + normalised exact match, for extractive "
        "answers), 'rouge_l' (ROUGE-L + normalised exact match, for open-ended answers), or your own "
        "'module:function' (predictions, references -> dict; imported only when named here). 'auto': squad for "
        "input/target rows, rouge_l for conversations.")
    eval_generate: bool | None = opt(
        None, "Generate answers and score them at each evaluation; false: validation loss only. Default: generate when "
        "the answers are short (the longest validation answer at most 64 tokens) or --max_new_tokens is given; for "
        "longer answers the loss only, said in the run: on 64 chat rows generating 8 long answers twice took about "
        "as long as the training epoch (docs/performance.md).")
    eval_generate_batch_size: int | None = opt(
        None, "Rows generation decodes at once; prompts still run --eval_batch_size at a time and their caches are "
        "stacked. Default: the planner's choice (up to 32, as the KV cache fits in memory). A decode step costs little "
        "more for more rows; in 16 bits a larger step can round differently and flip an answer token at a near-tie "
        "(measured in docs/performance.md). Set it to the evaluation batch for the earlier generation: each batch "
        "prefilled and decoded alone, the tokens of generate() on the same batches.")
    eval_merge_lora: bool = opt(
        False, "Generate evaluation answers with the LoRA adapter merged into a temporary copy of the adapted weights "
        "(one matmul per layer): under 16-bit autocast what peft's merge_and_unload() model computes, 16-bit layer "
        "outputs with no casts around them (faster prompts). The merged weights round away part of a young adapter "
        "and the layer outputs are not summed in fp32, so answers can differ from the model training computes "
        "(agreement measured in docs/performance.md). false: the adapter applied as in training.")
    eval_pack_lora: bool = opt(
        False, "Generate evaluation answers with each LoRA layer (q, k and v together; gate and up together) as one "
        "16-bit matmul over [input | adapter projection] and [weight | B] side by side: the adapter is never rounded "
        "into the weights, but each layer's output is rounded to 16 bits once instead of summed in fp32, so an answer "
        "can differ at a near-tie (agreement with fp32 measured in docs/performance.md). Costs a copy of the adapted "
        "weights while generating. false: the adapter applied as in training.")
    eval_share_prefixes: bool = opt(
        False, "Generation computes a prompt beginning that evaluation prompts share (16 tokens or more, e.g. one "
        "SQuAD paragraph) once. Computed in another batch shape, it can round differently under 16-bit precision and "
        "flip an answer token at a near-tie. false: every prompt computed whole, as generate() does.")
    eval_loss_in_prefill: bool = opt(
        True, "An evaluation that generates computes its validation loss and its prompts in one forward: each example "
        "(prompt and answer) runs once, and generation continues from the prompt's part of it, where the earlier "
        "evaluation ran the examples for the loss and then the prompts again. The same numbers in exact arithmetic; "
        "under 16-bit precision the loss can differ in its last digits and an answer token can flip at a near-tie "
        "(measured in docs/performance.md). false: two passes, the prompts computed alone as generate() does.")
    max_seq_length: int = opt(512, "Longest prompt + target in tokens. Prompts are cut to fit; targets never are.")
    truncation_side: Literal["left", "right"] = opt(
        "left", "Which end of the input to cut when a prompt is too long ('left' keeps the end, e.g. a question)."
    )
    augmentation_factor: int = opt(1, "N: each training row plus N-1 augmented variants (training rows only).")
    share_prefixes: bool = opt(
        True, "Compute a prompt prefix that rows of a micro-batch share (32 tokens or more) once in training; the loss "
        "is the same. false: every row computes its own (and draws its own LoRA dropout masks there).")
    pad_to_multiple_of: int | None = opt(
        None, "Pad each training batch's length up to a multiple of N tokens (the padding carries no loss and is hidden "
        "by causal attention: the same loss up to rounding). Fewer batch shapes keep a CPU run's memory from growing "
        "shape after shape (oneDNN keeps kernels per shape, and glibc's heap fragments around them): with 64 on 64 chat "
        "rows the epoch's peak fell from 3.58 to 2.90 GB but the whole run's only from 3.39 to 3.21 GB, for about 3.5% "
        "more CPU time, so it is off by default (docs/performance.md). null: pad to the longest row only.")
    fused_cross_entropy: bool = opt(
        True, "Run the LM head and the cross-entropy fused, in chunks: no full logits tensor in memory, the same loss "
        "and gradients. false: the unfused head (its logits for all supervised tokens at once).")
    prompt_lookup_num_tokens: int = opt(
        0, "Prompt lookup decoding for evaluation answers (model.generate's flag): each decode step also runs up to N "
        "draft tokens copied from where the answer's last tokens occur in its prompt, and keeps those the model "
        "confirms as its own greedy choice: the same answers in exact arithmetic, in fewer forwards where answers copy "
        "from the prompt (extractive QA, tool arguments). How many it runs per step is chosen for the hardware: a wide "
        "step costs little on a GPU and in bf16, much on a CPU in fp32 (measured in docs/performance.md). Under 16-bit "
        "precision a wider step rounds differently and can flip a near-tie. 0: one token per step.")
    max_new_tokens: int | None = opt(
        None, "Generation length for evaluation. Default: the longest answer of the rows scored (the validation "
        "answers; without validation rows, the training targets) in tokens, plus 4."
    )

    def problems(self) -> list[Problem]:
        p = super().problems()
        at_least(p, self, "augmentation_factor", 1)
        if self.metric not in ("auto", "squad", "rouge_l") and ":" not in self.metric:
            p.append(Problem(f"unknown metric {self.metric!r}", "--metric",
                             "use auto, squad, rouge_l or your own module:function"))
        at_least(p, self, "max_new_tokens", 1)
        at_least(p, self, "prompt_lookup_num_tokens", 0)
        at_least(p, self, "pad_to_multiple_of", 1)
        at_least(p, self, "eval_generate_batch_size", 1)
        if self.chat_format and self.chat_template is False:
            p.append(Problem(f"--chat_format {self.chat_format} and --chat_template false both given",
                             "--chat_template", "drop one: --chat_format sets the chat template, false uses none"))
        if self.template is not None:
            import re

            names = re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", self.template)
            if not names:
                p.append(Problem(f"names no field of the rows (e.g. {{input}}) in {self.template!r}", "--template",
                                 'e.g. --template "Question: {input}\\nAnswer: " or "{instruction}\\n\\n{input}"'))
            if self.template.count("{input}") > 1:
                p.append(Problem(f"must contain {{input}} at most once (found {self.template.count('{input}')} times "
                                 f"in {self.template!r})", "--template", 'e.g. --template "Question: {input}\\nAnswer: "'))
            if self.chat_template:
                p.append(Problem("--template and --chat_template both given", "--chat_template", "use one of them"))
        return p


# ---------------------------------------------------------------------------------------------------- type handling


def field_kind(tp: Any) -> tuple[type, bool, tuple | None]:
    """(base type, optional?, literal choices) for a dataclass field annotation."""
    if isinstance(tp, str):  # `from __future__ import annotations` leaves strings; resolve against typing
        tp = eval_annotation(tp)
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
        origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), optional, choices
    return tp, optional, None


_ANNOTATION_NAMES = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None)}


def eval_annotation(text: str) -> Any:
    """Resolve the few annotation spellings our configs use, without ``eval``."""
    text = text.strip()
    if "|" in text:
        parts = [eval_annotation(t) for t in text.split("|")]
        out = parts[0]
        for part in parts[1:]:
            out = out | part
        return out
    if text.startswith("Literal[") and text.endswith("]"):
        inner = text[len("Literal[") : -1]
        values = tuple(yaml.safe_load(f"[{inner}]"))
        return Literal[values]
    if text in _ANNOTATION_NAMES:
        return _ANNOTATION_NAMES[text]
    raise TypeError(f"unsupported config annotation: {text}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def convert(value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's type; raises ValueError with a readable reason."""
    base, optional, choices = field_kind(tp)
    if value is None or (isinstance(value, str) and value.lower() in {"none", "null"} and optional):
        if optional:
            return None
        raise ValueError("a value is required")
    out: bool | int | float | str
    if base is bool:
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            out = value.lower() in _TRUE
        else:
            raise ValueError(f"expected true or false, got {value!r}")
    elif base is int:
        # YAML gives 3 or 3.0, the command line "3"; 2.5 or "2.5" is an error, never a silent floor.
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected a whole number, got {value!r}")
        try:
            out = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a whole number, got {value!r}") from None
    elif base is float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
    else:
        out = _text(value)
    if choices is not None and out not in choices:
        raise ValueError(f"expected one of {', '.join(map(str, choices))}; got {value!r}")
    return out


def _text(value: Any) -> str:
    """A text setting's value: text, a path, or a number YAML read as one. An object (a DataFrame, a ``datasets``
    table, rows in a list) is refused by its kind: its ``str()`` would be read as a file name."""
    import os

    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    kind = type(value).__module__.split(".")[0] + "." + type(value).__name__
    if isinstance(value, (list, tuple)):
        kind = f"a list of {len(value)} {type(value[0]).__name__ if value else 'items'}" + ("s" if len(value) != 1 else "")
    elif isinstance(value, dict):
        kind = f"a dict with keys {', '.join(map(str, list(value)[:5]))}"
    raise ValueError(f"expected text (a file path or a name), got {kind}")


# Said after a data setting that got an object: the rows must be in a file that the run's config can name.
_SAVE_ROWS = ("; surefit reads data from files, so a run can be resumed and evaluated from its config. Save the rows "
              "as JSON Lines and pass the path: df.to_json('train.jsonl', orient='records', lines=True) for a pandas "
              "DataFrame, ds.to_json('train.jsonl') for a datasets.Dataset, or one json.dumps(row) a line for dicts")


# ---------------------------------------------------------------------------------------------------- loading


def build_config(cls: type, yaml_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 yaml_name: str = "config file", earlier: list[Problem] | None = None,
                 overrides_name: str = "command line") -> Any:
    """Make a validated config: dataclass defaults < preset < ``yaml_values`` < ``overrides``.

    The preset is named by ``preset`` in the overrides or the YAML. Every problem (unknown keys, wrong types, bad
    ranges, cross-field conflicts) is collected and raised once, with the ``earlier`` problems the caller found
    (other tools' setting names, ``surefit/config/aliases.py``). The config's ``preset_only`` (not a field) names the settings
    only the preset gave.
    """
    problems: list[Problem] = list(earlier or [])
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    preset_name = (overrides or {}).get("preset") or (yaml_values or {}).get("preset")
    preset_values: dict[str, Any] = {}
    if preset_name:
        preset_values, preset_problems = load_preset(str(preset_name))
        problems += preset_problems
    layers = ((f"preset {preset_name}", preset_values), (yaml_name, yaml_values or {}),
              (overrides_name, overrides or {}))
    given_later: set[str] = set()
    unconverted: set[str] = set()  # a setting whose value did not convert is not checked again as missing
    for index, (source_name, source) in enumerate(layers):
        if index > 0:  # the YAML file and the flags: what the user gave, over the preset
            given_later |= {str(k).replace("-", "_") for k in source}
        for key, raw in source.items():
            key = key.replace("-", "_")
            if key not in known:
                close = difflib.get_close_matches(key, list(known), n=1)
                fix = f"did you mean '{close[0]}'?" if close else "see `surefit train --help` for the settings"
                problems.append(Problem(f"unknown setting '{key}' (in the {source_name})", f"--{key}", fix))
                continue
            if key.endswith("_args") and isinstance(raw, dict):
                import json

                raw = json.dumps(raw)  # a YAML mapping for a JSON setting (model_args, head_args) means that JSON
            try:
                values[key] = convert(raw, known[key].type)
            except ValueError as e:
                advice = _SAVE_ROWS if key in ("data", "val_data") and str(e).startswith("expected text") else ""
                problems.append(Problem(f"{e} (in the {source_name}){advice}", f"--{key}"))
                unconverted.add(f"--{key}")
    # Range and cross-field checks run on the values that did convert, so one report holds every problem.
    cfg = cls(**values)
    found = cfg.problems()
    # A NaN or infinite value is named once as such: the range checks it also fails would only repeat it.
    nonfinite = {q.where for q in found if q.what.startswith(NONFINITE)}
    problems += [q for q in found if q.where not in unconverted
                 and (q.where not in nonfinite or q.what.startswith(NONFINITE))]
    if problems:
        raise ConfigError(problems)
    # Not a field: the settings only the preset gave (a GPU preset's CPU-only slowdowns are dropped on a CPU).
    cfg.preset_only = {str(k).replace("-", "_") for k in preset_values} - given_later
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as YAML that ``--config`` reads back to the same config.

    ``resume`` and ``overwrite`` describe one invocation, not the run, so they are not saved.
    """
    values = {k: v for k, v in config_to_dict(cfg).items() if k not in ("resume", "overwrite")}
    Path(path).write_text(yaml.safe_dump(values, sort_keys=False), encoding="utf-8")
