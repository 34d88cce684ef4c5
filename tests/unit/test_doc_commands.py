"""The docs' command check (tests/doc_commands.py) fails on what does not exist."""

from doc_commands import bash_blocks, check_text, commands, section

GOOD = """
Prose with `make demo` and `benchmarks/ssh_fanout.py --guests 32`.

```bash
vcfslm size --peak-streams 64 --results runs/lab-1n   # a comment
vcfslm bench --local --serve --rates 1,2 \\
    --input-tokens 32 --output-tokens 8
vcfslm probe --mib 64 -o json > probe.json
DEMO_FRESH=1 make demo
.venv/bin/python benchmarks/provision_fanout.py --vms 64
cp inventories/vx650v4-4node.yaml cluster.yaml
```
"""


def test_good_commands_pass():
    assert check_text(GOOD) == []


def test_continuations_and_comments():
    (block,) = bash_blocks(GOOD)
    argvs = commands(block)
    assert argvs[0] == ["vcfslm", "size", "--peak-streams", "64", "--results", "runs/lab-1n"]
    assert argvs[1][-2:] == ["--output-tokens", "8"]


def test_a_made_up_option_fails():
    problems = check_text("```bash\nvcfslm size --peak-streams 64 --made-up-option 3\n```\n")
    assert len(problems) == 1 and "vcfslm size" in problems[0]


def test_a_made_up_subcommand_fails():
    assert check_text("```bash\nvcfslm lab upp --nodes 4\n```\n")


def test_an_indented_block_is_checked():
    assert check_text("- a list item:\n\n  ```bash\n  vcfslm plan --made-up\n  ```\n")


def test_a_made_up_make_target_fails():
    assert check_text("```bash\nmake demo-everything\n```\n")
    assert check_text("Run `make demo-everything` first.\n")


def test_a_made_up_benchmark_or_its_option_fails():
    assert check_text("```bash\n.venv/bin/python benchmarks/no_such_bench.py\n```\n")
    assert check_text("```bash\n.venv/bin/python benchmarks/ssh_fanout.py --guests 4 --made-up\n```\n")
    assert check_text("As `benchmarks/ssh_fanout.py --made-up 2` measured.\n")
    assert check_text("See benchmarks/no_such_bench.py.\n")


def test_section_stops_at_the_next_heading_not_at_a_comment():
    text = "## A\n```bash\n# a comment\nvcfslm plan\n```\n## B\nmore\n"
    assert "vcfslm plan" in section(text, "## A") and "more" not in section(text, "## A")
