"""Write the recipes' data files from English text that ships with CPython (``pydoc_data.topics``).

- ``python_docs.txt``: the documentation of Python's statements, expressions and built-in types (the text
  ``help()`` shows), one topic after another. Language-model pre-training and fine-tuning text.
- ``python_docs_train.jsonl`` / ``python_docs_val.jsonl``: one ``{"topic": ..., "text": ...}`` document per
  topic; the topics in ``VAL_TOPICS`` go to the validation file, the others to the training file.
- ``python_docs_sft_train.jsonl`` / ``python_docs_sft_val.jsonl``: one ``{"topic", "prompt", "response"}``
  example per topic that has a prose paragraph, for supervised fine-tuning: the prompt is the topic's title and an
  instruction, the response the topic's first prose paragraph; split as the documents are (``VAL_TOPICS``).
- ``python_docs_topics.csv``: paragraphs of those topics with a label saying which family their topic belongs
  to: ``statement`` (the topics of Python's statements: ``for``, ``try``, ``import``, ...) or ``type`` (the
  topics of built-in types and their methods: ``typesseq``, ``string-methods``, ``dict``, ...). Topics of
  neither family are left out. The label is a fact about where the paragraph comes from, not a guess.

The committed files were made with CPython 3.11; run ``python recipes/data/make_data.py`` to remake them.
Python's documentation is under the PSF License Agreement, which permits redistribution with its notice
(https://docs.python.org/3/license.html).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

STATEMENTS = [
    "assert",
    "assignment",
    "async",
    "augassign",
    "break",
    "class",
    "compound",
    "continue",
    "del",
    "for",
    "function",
    "global",
    "if",
    "import",
    "nonlocal",
    "pass",
    "raise",
    "return",
    "try",
    "while",
    "with",
]
TYPES = [
    "bltin-code-objects",
    "bltin-ellipsis-object",
    "bltin-null-object",
    "bltin-type-objects",
    "callable-types",
    "dict",
    "numeric-types",
    "sequence-types",
    "specialattrs",
    "string-methods",
    "types",
    "typesfunctions",
    "typesmapping",
    "typesmethods",
    "typesmodules",
    "typesseq",
    "typesseq-mutable",
]

VAL_TOPICS = ["await", "lambda", "naming", "operator-summary", "slicings", "typesmapping", "while", "yield"]


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a topic: joined lines, at least 80 characters, code examples and tables left out."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines()]
        if not lines or block.startswith("   ") or any(line.startswith((">>>", "+--", "===")) for line in lines):
            continue
        paragraph = " ".join(lines)
        if len(paragraph) >= 80:
            out.append(paragraph[:1000])
    return out


def sft_example(key: str, text: str) -> dict[str, str] | None:
    """A prompt/response pair from a topic: its title and an instruction, then its first prose paragraph."""
    found = paragraphs(text)
    if not found:
        return None
    title = text.splitlines()[0].strip()
    return {"topic": key, "prompt": f"{title}\n\nExplain this part of Python in one paragraph.\n", "response": found[0]}


def main() -> None:
    from pydoc_data.topics import topics

    (HERE / "python_docs.txt").write_text("\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    for name, keep in (("train", lambda k: k not in VAL_TOPICS), ("val", lambda k: k in VAL_TOPICS)):
        with open(HERE / f"python_docs_{name}.jsonl", "w", encoding="utf-8") as f:
            for key in filter(keep, sorted(topics)):
                f.write(json.dumps({"topic": key, "text": topics[key]}) + "\n")
        with open(HERE / f"python_docs_sft_{name}.jsonl", "w", encoding="utf-8") as f:
            for key in filter(keep, sorted(topics)):
                if (example := sft_example(key, topics[key])) is not None:
                    f.write(json.dumps(example) + "\n")
    with open(HERE / "python_docs_topics.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label", "topic"])
        for label, keys in (("statement", STATEMENTS), ("type", TYPES)):
            for key in keys:
                for paragraph in paragraphs(topics[key]):
                    writer.writerow([paragraph, label, key])


if __name__ == "__main__":
    main()
