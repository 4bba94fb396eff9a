"""Build examples/dpo/pairs.jsonl: preference pairs from the SFT conversations of glaive_toolcall_en_demo.json.

Each conversation that opens with a user turn answered in 6 to 60 words (not a tool call) gives one pair, 106 in all:
that first user turn is the prompt (ShareGPT ``conversations``; the tools are left out, the first answer uses none),
the answer it has is ``chosen``, and ``rejected`` is a worse answer built from the data, seeded:
- for even rows, another such conversation's first answer (fluent, but it answers something else);
- for odd rows, the chosen answer cut to its first third of words (it stops mid-sentence).
The layout is LLaMA-Factory's (``conversations`` + ``chosen`` / ``rejected`` messages), read with no flag.

    python examples/dpo/make_pairs.py ../shared/data/chat/glaive_toolcall_en_demo.json examples/dpo/pairs.jsonl
"""

import json
import random
import sys


def main(source: str, target: str, n: int = 120, seed: int = 0) -> None:
    rows = json.load(open(source, encoding="utf-8"))
    usable = [r for r in rows if len(r["conversations"]) >= 2 and r["conversations"][0]["from"] == "human"
              and r["conversations"][1]["from"] == "gpt" and 6 <= len(r["conversations"][1]["value"].split()) <= 60][:n]
    rng = random.Random(seed)
    out = []
    for i, r in enumerate(usable):
        turns = r["conversations"][:2]
        answer = turns[-1]["value"]
        if i % 2 == 0:
            other = usable[(i + 1 + rng.randrange(len(usable) - 1)) % len(usable)]["conversations"][1]["value"]
            rejected = other if other.strip() != answer.strip() else " ".join(answer.split()[: len(answer.split()) // 3])
        else:
            words = answer.split()
            rejected = " ".join(words[: max(1, len(words) // 3)])
        out.append({"conversations": turns[:-1], "chosen": {"from": "gpt", "value": answer},
                    "rejected": {"from": "gpt", "value": rejected}})
    with open(target, "w", encoding="utf-8") as f:
        for x in out:
            f.write(json.dumps(x, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} pairs to {target}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
