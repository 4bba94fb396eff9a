"""SQuAD JSON: one row per question, with every gold answer kept for scoring."""

from __future__ import annotations

from typing import Any

from surefit.data.readers.common import SQUAD_SHAPE, CappedProblems, Rejected, raw_json
from surefit.data.rows import Row
from surefit.errors import Problem


def flatten_squad(
    obj: dict, source: str, problems: list[Problem], *, rejects: list[Rejected] | None = None
) -> list[Row]:
    """Turn a SQuAD-format object into one row per answerable question.

    Each row has ``input`` (``"{context}\\n\\nQuestion: {question}"``), ``target`` (the first answer's text),
    ``answers`` (every distinct answer text, in order, for scoring), ``id``, ``context`` and ``question``.

    Args:
        obj: the parsed file, ``{"data": [{"paragraphs": [{"context": ..., "qas": [...]}]}]}``.
        source: the file's path as shown in messages.
        problems: unanswerable questions (SQuAD v2) and malformed entries are appended here.
        rejects: when a list (``--on_bad_rows skip``), those questions and entries are appended here instead.

    Returns:
        The rows of the well-formed, answerable questions.
    """
    rows: list[Row] = []
    unanswerable = CappedProblems(problems, source, "questions", rejects)
    malformed = CappedProblems(problems, source, "entries", rejects)
    shape_fix = f"SQuAD files need {SQUAD_SHAPE}; fix or remove this entry"
    for a, article in enumerate(obj.get("data") or [], 1):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            malformed.add(
                Problem("'paragraphs' is not a list", where=f"{source} (article {a})", fix=shape_fix),
                raw=raw_json(article),
            )
            continue
        for p, paragraph in enumerate(paragraphs, 1):
            place = f"article {a}, paragraph {p}"
            if not isinstance(paragraph, dict):
                malformed.add(
                    Problem("paragraph is not an object", where=f"{source} ({place})", fix=shape_fix),
                    raw=raw_json(paragraph),
                )
                continue
            context = paragraph.get("context")
            qas = paragraph.get("qas")
            if not isinstance(context, str) or not isinstance(qas, list):
                malformed.add(
                    Problem(
                        "paragraph needs a string 'context' and a list 'qas'",
                        where=f"{source} ({place})",
                        fix=shape_fix,
                    ),
                    raw=raw_json(paragraph),
                )
                continue
            for q, qa in enumerate(qas, 1):
                row = _squad_row(qa, context, source, place, f"{a}.{p}.{q}", len(rows), unanswerable, malformed)
                if row is not None:
                    rows.append(row)
    unanswerable.close()
    malformed.close()
    return rows


def _squad_row(
    qa: Any,
    context: str,
    source: str,
    place: str,
    fallback_id: str,
    index: int,
    unanswerable: CappedProblems,
    malformed: CappedProblems,
) -> Row | None:
    shape_fix = f"SQuAD files need {SQUAD_SHAPE}; fix or remove this question"
    if not isinstance(qa, dict):
        malformed.add(
            Problem("question entry is not an object", where=f"{source} ({place})", fix=shape_fix), raw=raw_json(qa)
        )
        return None
    # An id is only a label for reports; a file without ids still trains, so number the question instead.
    qid = qa.get("id", fallback_id)
    where = f"{source} question id {qid} ({place})"
    question = qa.get("question")
    answers = qa.get("answers")
    if not isinstance(question, str) or not isinstance(answers, list):
        malformed.add(
            Problem("question needs a string 'question' and a list 'answers'", where=where, fix=shape_fix),
            raw=raw_json(qa),
        )
        return None
    texts: list[str] = []
    for answer in answers:
        text = answer.get("text") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            malformed.add(Problem("an answer has no string 'text'", where=where, fix=shape_fix), raw=raw_json(qa))
            return None
        if text not in texts:
            texts.append(text)
    if not texts or qa.get("is_impossible") is True:
        unanswerable.add(
            Problem(
                f"question {qid} has no answer (SQuAD v2 unanswerable): {question!r}",
                where=where,
                fix="remove unanswerable questions (or pre-filter: keep questions whose 'answers' list is non-empty)",
            ),
            raw=raw_json(qa),
        )
        return None
    fields = {
        "input": f"{context}\n\nQuestion: {question}",
        "target": texts[0],
        "answers": texts,
        "id": qid,
        "context": context,
        "question": question,
    }
    return Row(fields=fields, where=where, index=index)
