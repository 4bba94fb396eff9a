"""Scoring generated text: SQuAD-style exact match and token F1, and ROUGE-L (classification: ``classification.py``).

The SQuAD functions reproduce the official v1.1 evaluation script (normalisation, Counter-based token overlap, max
over gold answers) so that numbers reported by surefit can be compared with published ones. The one deliberate
difference is documented on :func:`token_f1`.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Normalise an answer exactly as the official SQuAD v1.1 script does.

    Steps, in the official order: lowercase, drop every character in ``string.punctuation``, replace the articles
    "a", "an", "the" (whole words) with a space, collapse whitespace runs to single spaces and strip.

    Args:
        s: a predicted or gold answer.

    Returns:
        The normalised answer; may be empty (e.g. ``"a"`` or ``"!"``).
    """
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 if the normalised prediction equals the normalised gold answer, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between a prediction and one gold answer, as in the official SQuAD script.

    Tokens are the whitespace-split normalised strings; overlap is the multiset intersection, so a token repeated
    in the prediction only counts as many times as it appears in the gold answer.

    Convention for empty answers: if both normalise to empty the score is 1.0 (they agree; this is the SQuAD v2
    script's rule), if exactly one is empty it is 0.0. The v1.1 script returns 0.0 for empty/empty because it has
    no common tokens; golds that normalise to empty (e.g. ``"the"``) are rare in SQuAD v1.1, so this only matters
    for degenerate data.

    Args:
        prediction: the model's answer.
        gold: one reference answer.

    Returns:
        F1 in [0, 1].
    """
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def rouge_l(prediction: str, gold: str) -> float:
    """ROUGE-L F1 (longest common subsequence of normalised tokens) for open-ended answers, where token F1 rewards
    a bag of words and exact match is too strict. Both empty: 1.0; one empty: 0.0."""
    a, b = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def squad_scores(predictions: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Corpus-level SQuAD scores: for each example the best score over its gold answers, then the mean.

    Args:
        predictions: one predicted answer per example.
        golds: for each example, every acceptable gold answer (at least one).

    Returns:
        ``{"f1": ..., "em": ...}`` as fractions in [0, 1] (the official script reports percentages).

    Raises:
        ValueError: no examples, a length mismatch, or an example with no gold answers (its index is named).
    """
    if len(predictions) != len(golds):
        raise ValueError(f"squad_scores: {len(predictions)} predictions but {len(golds)} gold lists")
    if not predictions:
        raise ValueError("squad_scores: no examples to score")
    f1_total = em_total = 0.0
    for i, (pred, answers) in enumerate(zip(predictions, golds, strict=True)):
        # A bare string would be iterated character by character and score nonsense without any error.
        if isinstance(answers, str):
            raise ValueError(f"squad_scores: golds[{i}] is a string; pass a list of gold answers")
        if not answers:
            raise ValueError(f"squad_scores: example {i} has no gold answers")
        f1_total += max(token_f1(pred, gold) for gold in answers)
        em_total += max(exact_match(pred, gold) for gold in answers)
    n = len(predictions)
    return {"f1": f1_total / n, "em": em_total / n}
