"""Re-paste the tables embedded in README.md from their generated files (results/tables/*/*.md).

    python3 scripts/readme_tables.py        # after `snakemake figures --configfile PROFILE`

Each generated table starts with its title line; the README block under the same title (the table and
its notes line) is replaced by the file's content. A title the README does not carry is reported and
left out; where two files share a title, the later one (sorted path) wins, as only one block carries it.
"""
import glob
import sys


def paste(readme: list[str], src: list[str]) -> bool:
    title = src[0]
    if title not in readme:
        return False
    i = readme.index(title)
    j = i + 1
    while j < len(readme) and readme[j].strip() == "":
        j += 1
    while j < len(readme) and readme[j].startswith("|"):
        j += 1
    k = j
    while k < len(readme) and readme[k].strip() == "":
        k += 1
    # the notes line under the table starts with the same word as the file's last line
    if k < len(readme) and not src[-1].startswith("|") and readme[k].split(":")[0] == src[-1].split(":")[0]:
        j = k + 1
    readme[i:j] = src
    return True


def main(path: str = "README.md") -> None:
    readme = open(path).read().split("\n")
    for md in sorted(glob.glob("results/tables/*/*.md")):
        src = open(md).read().rstrip("\n").split("\n")
        print(("pasted " if paste(readme, src) else "not in README: ") + md)
    open(path, "w").write("\n".join(readme))


if __name__ == "__main__":
    main(*sys.argv[1:])
