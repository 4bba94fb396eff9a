"""What a raw error's text says: the patterns the doctor's explanations match, shared by ``explain`` and the checks
that tell a failed dry run's cause."""

from __future__ import annotations

import re

# A raw error's text -> the codes whose findings can explain it, most specific first.
PATTERNS: list[tuple[str, tuple[str, ...]]] = [
    (r"expected sequence of length \d+ at dim \d+ \(got \d+\)", ("labels-not-padded", "ragged-batch")),
    (r"each element in list of batch should be of equal size", ("ragged-batch", "labels-not-padded")),
    (r"Target size \(.*\) must be the same as input size", ("label-shape", "label-dtype", "label-one-hot")),
    (r"device-side assert|CUDA error: an illegal|srcIndex < srcSelectDimSize|t >= 0 && t < n_classes",
     ("label-out-of-range", "token-id-out-of-range", "token-type-out-of-range", "sequence-too-long")),
    (r"Expected input batch_size \(\d+\) to match target batch_size", ("label-shape", "label-one-hot")),
    (r"stack expects each tensor to be equal size", ("ragged-batch", "labels-not-padded")),
    (r"Unable to create tensor.*padding", ("labels-not-padded", "ragged-batch", "label-not-numeric")),
    (r"mat1 and mat2 shapes cannot be multiplied", ("input-dim-mismatch",)),
    (r"got an unexpected keyword argument '(\w+)'", ("unexpected-columns",)),
    (r"only integer tensors of a single element can be converted to an index", ("label-not-numeric",
                                                                                 "label-one-hot")),
    (r"too many dimensions 'str'|new\(\): invalid data type 'str'", ("label-not-numeric",)),
    (r"Target -?\d+ is out of bounds|out of bounds", ("label-out-of-range",)),
    (r"index out of range in self", ("token-id-out-of-range", "token-type-out-of-range", "sequence-too-long")),
    (r"expected scalar type Long but found Float|expected .*Long.*Float|result type Float can't be cast|"
     r"Found dtype Long but expected Float|class probabilities, got Long", ("label-dtype", "label-one-hot")),
    (r"0D or 1D target tensor expected, multi-target not supported", ("label-one-hot",)),
    (r"Cannot handle batch sizes > 1 if no padding token is defined", ("classifier-no-pad-id",)),
    (r"Asking to pad but the tokenizer does not have a padding token", ("no-pad-token",)),
    (r"out of memory", ("memory-over-budget",)),
    (r"(Can't|cannot) pickle|pickl", ("unpicklable-worker-data",)),
    (r"Attempting to unscale FP16 gradients", ("fp16-master-weights",)),
    (r"Target modules .* not found", ("lora-targets-missing",)),
    (r"does not require grad|element 0 of tensors does not require grad", ("no-labels",)),
    (r"must have the same dtype", ("input-dim-mismatch",)),
]


def codes_in(text: str) -> list[tuple[str, ...]]:
    """The code groups of every pattern ``text`` matches, most specific first."""
    return [codes for pattern, codes in PATTERNS if re.search(pattern, text, flags=re.IGNORECASE | re.DOTALL)]
