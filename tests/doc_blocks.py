"""The code blocks of README.md and docs/*.md, and what their fences say about running them (standard
library only: tests/test_layout.py checks the marks, tests/scripts/test_doc_commands.py runs the blocks).

Every fence names its language. A `bash` block is commands, and runs as written, in order, against a
local cluster, unless a word after `bash` says why it cannot (```` ```bash azure ````); the words are
NOT_RUN's. Output, synopses with [optional] parts, trees and diagrams are `text`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMANDS = "bash"
NOT_RUN = {
    "azure": "needs an Azure subscription: pulumi, az, or the Azure stack's hosts",
    "placeholders": "holds values to replace with your own (<run-id>, JOB, a file or a path of yours)",
    "gpu": "needs a CUDA GPU, or is sized for one",
    "suite": "runs the set-up, the demo or a test suite (make setup, demo, test), each run on its own",
    "bench": "a benchmark or a measurement: minutes to hours of timed runs (the figures beside it)",
    "synopsis": "a usage synopsis with [optional] parts, not a command",
}
_FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    language: str
    marks: tuple[str, ...]  # the words after the language
    body: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language == COMMANDS and not self.marks


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    found = []
    for match in _FENCE.finditer(text):
        language, *marks = match["info"].split() or [""]
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(doc, line, language, tuple(marks), match["body"]))
    return found
