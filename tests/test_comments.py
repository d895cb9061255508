"""Comments and docstrings of trace/, kernels/ and workflow/ say what the code does and why, in the present tense: no
benchmark version tag (`v5k`, `m1`, `f1`, ...) names a past measurement there. The measurements themselves live in
kernels/NOTES.md, results/*/README.md and the results tables, which may use the tags."""
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a tag: v, m or f and a digit, an optional letter, as a word of its own; a software version (`v0.1`, `v2.0`) is not
TAG = re.compile(r"(?<![\w.-])(?:v\d+[a-z]?|m\d|f\d)(?![\w.])")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python file, or of every `#` comment of a Snakemake
    file (whose rules tokenize does not parse)."""
    text = path.read_text()
    if path.suffix == ".smk" or path.name == "Snakefile":
        return [(i, line.split("#", 1)[1]) for i, line in enumerate(text.splitlines(), 1) if "#" in line]
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.start[0], tok.string))
    return out


def tags(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {m.group(0)}" for line, s in _prose(path) for m in TAG.finditer(s)]


def test_the_pattern_finds_tags_and_leaves_versions_and_names():
    assert TAG.findall("timed at v5k (kernels/NOTES.md v3a), m1 and f2") == ["v5k", "v3a", "m1", "f2"]
    assert TAG.findall("Mixtral-8x7B-v0.1, torch v2.13, pid_m, xm1, am1, --version dev") == []


def test_no_version_tag_in_comments_or_docstrings():
    files = [p for d in ("trace", "kernels", "workflow") for p in sorted((ROOT / d).rglob("*"))
             if p.suffix in (".py", ".smk")]
    assert len(files) > 50
    found = [t for p in files for t in tags(p)]
    assert found == [], "version tags in comments or docstrings (move the measurement to kernels/NOTES.md or a " \
                        "results README, say what the code does):\n" + "\n".join(found)
