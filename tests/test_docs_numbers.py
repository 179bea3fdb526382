"""Headline benchmark numbers have one source each, and every place that quotes one agrees with it.

``HEADLINES`` names each number (or tuple of numbers), the file and regular expression it is read from (the table or
sentence in docs/benchmarks.md or docs/screens.md that measures it), and the places that quote it: other lines of the
same pages, docs/*.md, training/configs/*.yaml, the Makefile. A quote agrees when its digits equal the source's
rounded to the quote's precision (so "59 GiB" quotes 59.1, "76 GiB" does not quote 76.9); a quote of a single number
against a source range ("about 6 minutes" against 5.7-5.8) agrees when it lies in the rounded range.

Not vacuous: every source pattern must match, all its matches must agree, and every required quote must be found.
README.md (being rewritten) and the pages other work is still adding are checked only where they quote a number in
the words the pattern looks for. No model loads: the files are read as text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUM = re.compile(r"\d+(?:\.\d+)?")
R3 = r"(\d\.\d\d / \d\.\d\d / \d\.\d\d)"  # "1.13 / 1.01 / 1.00"
X3 = r"(\d\.\d+x /\s+\d\.\d+x /\s+\d\.\d+x)"  # "1.13x / 1.01x / 1.00x", line breaks allowed
FLAGS = re.MULTILINE | re.DOTALL


def per_rank_row(model: str, shape: str, cp: int) -> str:
    """The GC-full total of one row of the per-rank table (8 x 80 GB, FSDP2, context parallelism ``cp``)."""
    return rf"^\| {re.escape(model)} \| {re.escape(shape)} \| {cp} \| \d+ \| [\d.]+ \| ([\d.]+) \|"


def one_card_row(model: str, shape: str) -> str:
    """The GC-full total of a shared-LoRA row of the memory-model table."""
    return rf"^\| {re.escape(model)} \| {re.escape(shape)} \| LoRA r64, shared base \| (?:[^|]+ \| ){{4}}([\d.]+) \("


A14B2 = "Wan2.2-I2V-A14B (both experts in one run)"


@dataclass
class Quote:
    file: str
    pattern: str
    pick: tuple[int, ...] | None = None  # which of the source's numbers the quote's numbers are (in order)
    optional: bool = False  # checked only if the pattern is found (README.md, pages other work is adding)
    in_range: bool = False  # a single number quoting a source range lo-hi


@dataclass
class Headline:
    source: tuple[str, str]  # (file, pattern); the groups of a match hold the numbers
    quotes: list[Quote] = field(default_factory=list)


B, S, README = "docs/benchmarks.md", "docs/screens.md", "README.md"

HEADLINES: dict[str, Headline] = {
    # make demo: FD ratio to the teacher at 1 / 2 / 4 steps, mean of 3 seeds (the default's table)
    "demo FD ratio": Headline(
        (B, r"^\| \*\*mean ± sd\*\* \| [^|]+ \| \*\*" + R3 + r"\*\*"),
        [
            Quote(B, r"^\| our sampler [^|]*\| [^|]*\| [^|]*\| " + R3 + r" \|$"),
            Quote(B, r"\(\d\.\d+x against (\d\.\d+)x the teacher's FD\)", pick=(0,)),
            Quote(B, r"2\s+steps \(\d\.\d+x against (\d\.\d+)x\)", pick=(1,)),
            Quote(S, r"the default reaches " + X3),
            Quote("docs/training.md", r"moved one step from \d\.\d+x to (\d\.\d+)x", pick=(0,)),
            Quote("training/configs/digits.yaml", r"1-step FD (\d\.\d+)x the teacher's", pick=(0,)),
            Quote("docs/sampling.md", r"against (\d\.\d+)x with the run's scheduler", pick=(0,), optional=True),
            Quote("docs/sampling.md", r"two steps \d\.\d+x against (\d\.\d+)x", pick=(1,), optional=True),
            Quote(README, r"reach(?:es)? " + X3, optional=True),
            Quote(
                README,
                r"(?:one-step|1-step) FD (?:is )?\d\.\d+x the teacher's.{0,80}?against (\d\.\d+)x",
                pick=(0,),
                optional=True,
            ),
            Quote(README, r"2 steps \d\.\d+x against (\d\.\d+)x", pick=(1,), optional=True),
        ],
    ),
    "demo pixel FD ratio": Headline(
        (B, r"^\| \*\*mean ± sd\*\* \| [^|]+ \| [^|]+ \| \*\*" + R3 + r"\*\*"),
        [
            Quote(README, r"goals [^;)]*; pixel\s+FD " + X3, optional=True),
        ],
    ),
    "demo goal": Headline(
        (B, r"\*\*Goal: at most " + X3 + r" the teacher's\s+FD at 1 / 2 / 4 steps\*\*"),
        [
            Quote(S, r"one-network goal \(≤ " + X3 + r" the teacher's FD"),
            Quote(S, r"The one-network goal \(" + X3 + r"\)"),
            Quote(README, r"goals? (?:of )?" + X3, optional=True),
        ],
    ),
    "demo 1-step diversity, teacher's": Headline(
        (B, r"diversity (\d\.\d\d) / \d\.\d\d / \d\.\d\d at 1 / 2 / 4 steps \(teacher: [\d.]+ and (\d\.\d\d)\)"),
        [
            Quote("docs/training.md", r"digits: (\d\.\d\d) against the teacher's (\d\.\d\d)"),
            Quote(
                "training/configs/digits.yaml", r"one-step diversity (\d\.\d\d) vs[\s#]+[\d.]+ \(teacher (\d\.\d\d)\)"
            ),
            Quote(README, r"diversity[^.]{0,60}?(\d\.\d\d) against the teacher's (\d\.\d\d)", optional=True),
        ],
    ),
    "demo time (min)": Headline(
        (B, r"\*\*`make demo` takes (\d+\.\d-\d+\.\d) min\*\*"),
        [
            Quote(B, r"^\| 0 \| 303 s \| 42 s \| (\d\.\d) min \| nothing \|$", pick=(0,)),
            Quote(README, r"(\d+(?:\.\d+)?-\d+(?:\.\d+)?) minutes alone", optional=True),
            Quote(README, r"takes about (\d+(?:\.\d+)?) minutes on an idle", optional=True, in_range=True),
        ],
    ),
    "regression term cost (s per student iteration, with / without)": Headline(
        (B, r"a student iteration (\d\.\d\d) s, of which .{0,120}?\((\d\.\d\d) s with `--regression_weight 0`\)"),
        [
            Quote("docs/training.md", r"on digits (\d\.\d\d) s against (\d\.\d\d) s per student iteration"),
            Quote(S, r"Its cost per student iteration\s+\((\d\.\d\d) s against (\d\.\d\d) s\)"),
        ],
    ),
    "no regression term: FD ratio": Headline(
        (S, r"\*\*" + X3 + r"\*\* the teacher's"),
        [
            Quote("docs/training.md", r"moved one step from (\d\.\d+)x to", pick=(0,)),
            Quote("training/configs/digits.yaml", r"vs (\d\.\d+)x without", pick=(0,)),
            Quote(README, r"against " + X3 + r" without the regression term", optional=True),
        ],
    ),
    # the diffusers user without the run's scheduler (RCMScheduler.from_config defaults): 1.84x vs 1.13x at 1 step
    "from_config defaults FD ratio": Headline(
        (B, r"^\| from_config defaults \(`pipe\(\.\.\.\)`\) \| [^|]+ \| [^|]+ \| " + R3 + r" \|$"),
        [
            Quote(B, r"\((\d\.\d+)x against \d\.\d+x the teacher's FD\)", pick=(0,)),
            Quote(B, r"2\s+steps \((\d\.\d+)x against \d\.\d+x\)", pick=(1,)),
            Quote("docs/sampling.md", r"one-step FD is (\d\.\d+)x the teacher's", pick=(0,), optional=True),
            Quote("docs/sampling.md", r"two steps (\d\.\d+)x against", pick=(1,), optional=True),
            Quote(README, r"(?:one-step|1-step) FD (?:is )?(\d\.\d+)x the teacher's", pick=(0,), optional=True),
            Quote(README, r"2 steps (\d\.\d+)x against", pick=(1,), optional=True),
        ],
    ),
    # make demo-experts
    "two-expert FD ratio": Headline(
        (B, r"^\| \*\*two-experts\*\* \| ema \| [^|]+ \| \*\*" + R3 + r"\*\*"),
        [
            Quote(B, r"\*\*Met at 1 step in classifier FD only\*\*: " + X3),
            Quote(README, r"two experts?\b[^.]{0,80}?" + X3, optional=True),
        ],
    ),
    "two-expert pixel FD ratio": Headline(
        (B, r"^\| \*\*two-experts\*\* \| ema \| [^|]+ \| [^|]+ \| [^|]+ \| \*\*" + R3 + r"\*\*"),
        [
            Quote(B, r"and in pixel FD " + X3),
        ],
    ),
    "two-expert goal": Headline(
        (B, r"\*\*Goal: two experts at most " + X3 + r" the two-expert\s+teacher's FD"),
        [
            Quote(README, r"two.expert[^.]{0,80}?goal[^.]{0,40}?" + X3, optional=True),
        ],
    ),
    "make demo-experts time (min)": Headline(
        (B, r"\*\*The whole 3-seed `make demo-experts` takes (\d+-\d+) min\*\*"),
        [
            Quote("Makefile", r"^#\s+make demo-experts .*?3 seeds \((\d+-\d+) min on a shared 2-core host\)"),
            Quote("Makefile", r"^# Not part of `make demo` \((\d+-\d+) min on a 2-core host"),
            Quote(README, r"demo-experts`?[^.\n]{0,120}?(?:about )?(\d+-\d+) min", optional=True),
            Quote(README, r"demo-experts`?[^.\n]{0,120}?about (\d+) min", optional=True, in_range=True),
            Quote("docs/training.md", r"demo-experts`?[^.\n]{0,120}?(\d+-\d+) min", optional=True),
        ],
    ),
    # memory model (python benchmarks/memory_table.py): per rank on 8 x 80 GB (FSDP2 + context parallelism)
    "14B 720p x 81 per rank, CP 1": Headline(
        (B, per_rank_row("Wan2.1-T2V-14B", "720p x 81 (75600)", 1)),
        [
            Quote(B, r"\*\*at 720p x 81 they need CP 2\*\* \(([\d.]+) GiB per rank at CP 1"),
            Quote(B, r"\(14B 720p x 81: ([\d.]+) GiB there"),
            Quote(README, r"14B[^.]{0,120}?720p[^.]{0,60}?need (\d+(?:\.\d+)?) GiB per rank", optional=True),
        ],
    ),
    "14B 720p x 81 per rank, CP 2": Headline(
        (B, per_rank_row("Wan2.1-T2V-14B", "720p x 81 (75600)", 2)),
        [
            Quote(B, r"GiB per rank at CP 1; ([\d.]+) GiB at CP 2, 30\.7"),
            Quote(README, r"\(context parallelism 2: (\d+(?:\.\d+)?) GiB\)", optional=True),
        ],
    ),
    "A14B both experts per rank: 480p CP 1, 720p CP 1, 720p CP 2": Headline(
        (
            B,
            ".*?".join(
                [
                    per_rank_row(A14B2, "480p x 81 (32760)", 1),
                    per_rank_row(A14B2, "720p x 81 (75600)", 1),
                    per_rank_row(A14B2, "720p x 81 (75600)", 2),
                ]
            ),
        ),
        [
            Quote(
                B,
                r"\*\*Both experts need ([\d.]+) GiB per rank at 480p x 81 and, at\s+720p x 81, CP 2\*\* "
                r"\(([\d.]+) GiB per rank at CP 1; ([\d.]+) GiB at CP 2",
            ),
            Quote(
                README,
                r"both (?:A14B )?experts[^.]{0,200}?(\d+(?:\.\d+)?) GiB per rank at 720p",
                pick=(2,),
                optional=True,
            ),
            Quote(
                README,
                r"both (?:A14B )?experts[^.]{0,200}?(\d+(?:\.\d+)?) GiB \(480p\) and (\d+(?:\.\d+)?) GiB "
                r"\(720p\) per rank",
                pick=(0, 1),
                optional=True,
            ),
        ],
    ),
    # memory model: one card
    "A14B both experts on one card: 480p, 720p (GiB)": Headline(
        (B, one_card_row(A14B2, "480p x 81 (32760)") + ".*?" + one_card_row(A14B2, "720p x 81 (75600)")),
        [
            Quote(B, r"fit one H200 at 480p \(([\d.]+) GiB\) but not at 720p \(([\d.]+) GiB\)"),
            *(
                Quote(
                    f"training/configs/wan2.2-{kind}-a14b.yaml",
                    r"both experts in one run: (\d+) GiB at 480p x 81 fits one H200, 720p \((\d+) GiB\) does not",
                )
                for kind in ("t2v", "i2v")
            ),
            Quote(README, r"in one run need about (\d+) GiB at 480p \(one H200\), (\d+) GiB at 720p", optional=True),
        ],
    ),
    "1.3B 480p x 81 on one card: full, selective (GiB)": Headline(
        (B, r"^\| Wan2\.1-T2V-1\.3B \| 480p x 81 \(32760\) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|"),
        [
            Quote(B, r"at 480p x 81 only with `full` checkpointing \(([\d.]+) GiB\); `selective` \(([\d.]+) GiB\)"),
            Quote(B, r"1\.3B distils on a 24 GB card in LoRA mode \(([\d.]+) GiB\)", pick=(0,)),
            Quote(B, r"\(prediction for that setup: ([\d.]+) GiB\)", pick=(0,)),
            Quote(
                README,
                r"1\.3B[^.]{0,60}?480p x 81[^.]{0,60}?24 GB[^.]{0,40}?\((\d+\.\d) GiB\)",
                pick=(0,),
                optional=True,
            ),
        ],
    ),
    "1.3B 480p x 33 on one card: full, selective (GiB)": Headline(
        (B, r"^\| Wan2\.1-T2V-1\.3B \| 480p x 33 \(14040\) \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|"),
        [
            Quote(B, r"fits 48 GB only at 480p x 33 \(([\d.]+) GiB\)", pick=(1,)),
            Quote(B, r"480p x 33 \(14 040 tokens;\s+predicted ([\d.]+) / ([\d.]+) GiB\)"),
        ],
    ),
    # QAD on digits: gap recovered, NVFP4 from the EMA and from the last weights
    "QAD NVFP4 gap recovered, EMA (mean, sd)": Headline(
        (B, r"^\| NVFP4 W\+A, CFG 1\.5 folded, \*\*power EMA 0\.1\*\* \|.*? \| \*\*(\d+)% ± (\d+)\*\* \|$"),
        [
            Quote("training/configs/qad-digits.yaml", r"recovers (\d+)% ± (\d+) of the"),
            Quote("docs/qad.md", r"recovers (\d+) ?% ± (\d+) of the naive-PTQ gap", optional=True),
            Quote(README, r"recovers (\d+) ?% ± (\d+) of the naive-PTQ gap", optional=True),
        ],
    ),
    "QAD NVFP4 gap recovered, last weights (mean, sd)": Headline(
        (B, r"^\| NVFP4 W\+A, CFG 1\.5 folded, last weights \|.*? \| (\d+)% ± (\d+) \|$"),
        [
            Quote("training/configs/qad-digits.yaml", r"vs (\d+)% ± (\d+) from the last weights"),
            Quote("docs/qad.md", r"against\s+(\d+) ?% ± (\d+) from the last\s+weights", optional=True),
            Quote(README, r"against\s+(\d+) ?% ± (\d+) from the last\s+weights", optional=True),
        ],
    ),
}


def _text(rel: str) -> str | None:
    p = ROOT / rel
    return p.read_text(encoding="utf-8") if p.exists() else None


def _numbers(match: re.Match) -> list[str]:
    out = []
    for g in match.groups():
        out += NUM.findall(g)
    return out


def _rounded_like(source: str, quote: str) -> Decimal:
    """``source`` rounded half up to as many decimals as ``quote`` shows."""
    return Decimal(source).quantize(Decimal(1).scaleb(-len(quote.partition(".")[2])), rounding=ROUND_HALF_UP)


def _agrees(quote: str, source: str) -> bool:
    """``quote`` equals ``source`` rounded to the quote's decimals."""
    return _rounded_like(source, quote) == Decimal(quote)


def _source_values(h: Headline) -> list[str]:
    rel, pattern = h.source
    text = _text(rel)
    assert text is not None, f"source file {rel} is missing"
    found = [_numbers(m) for m in re.finditer(pattern, text, FLAGS)]
    assert found, f"source pattern not found in {rel}: {pattern}"
    assert all(f == found[0] for f in found), f"{rel} states this number differently in its source lines: {found}"
    assert found[0], f"source pattern in {rel} captured no number"
    return found[0]


def _quote_problems(q: Quote, src: list[str], text: str | None) -> list[str]:
    """What is wrong with the quotes ``q`` finds in ``text`` against the source numbers ``src``."""
    matches = list(re.finditer(q.pattern, text, FLAGS)) if text is not None else []
    if not matches:
        return [] if q.optional else [f"{q.file}: required quote not found ({q.pattern})"]
    want = [src[i] for i in q.pick] if q.pick is not None else src
    problems = []
    for m in matches:
        got = _numbers(m)
        if q.in_range:  # one number quoting the range src[0]-src[-1]
            ok = len(got) == 1 and _rounded_like(src[0], got[0]) <= Decimal(got[0]) <= _rounded_like(src[-1], got[0])
        else:
            ok = len(got) == len(want) and all(_agrees(g, w) for g, w in zip(got, want))
        if not ok:
            problems.append(f"{q.file}: {m.group(0)!r} quotes {got}, the source says {src if q.in_range else want}")
    return problems


@pytest.mark.parametrize("name", list(HEADLINES))
def test_headline_source_is_found_and_quotes_agree(name):
    h = HEADLINES[name]
    src = _source_values(h)
    problems = [p for q in h.quotes for p in _quote_problems(q, src, _text(q.file))]
    assert not problems, f"{name} (source: {h.source[0]}):\n" + "\n".join(problems)


def test_agreement_rule_rounds_to_the_quote_and_rejects_truncation():
    assert _agrees("59", "59.1") and _agrees("77", "76.9") and _agrees("1.13", "1.13") and _agrees("100", "99.5")
    assert not _agrees("76", "76.9") and not _agrees("88", "89.4") and not _agrees("14.8", "14.9")
    assert not _agrees("0.95", "0.94")


def test_a_disagreeing_quote_fails():
    """The check itself: a Makefile line that states another time than the source is reported, a missing required
    quote too, a missing optional one is not."""
    h = HEADLINES["make demo-experts time (min)"]
    src = _source_values(h)
    line = "#   make demo-experts   two-expert ..., 3 seeds (35-55 min on a shared 2-core host)"
    assert _quote_problems(h.quotes[0], src, line)
    assert not _quote_problems(h.quotes[0], src, line.replace("35-55", "-".join(src)))
    assert _quote_problems(h.quotes[0], src, "no such line")
    assert not _quote_problems(Quote(README, h.quotes[0].pattern, optional=True), src, "no such line")


def test_benchmarks_page_holds_current_results_only():
    """docs/benchmarks.md: no words of a page's history, one link to the screens, every section with a date."""
    text = _text(B)
    history = re.findall(r"\b(was|now|earlier|previously|the old)\b", text, re.IGNORECASE)
    assert not history, f"history words in {B}: {sorted(set(history))}"
    links = re.findall(r"\]\((?:docs/)?screens\.md(?:#[^)]*)?\)", text)
    assert len(links) == 1, f"{B} should link docs/screens.md once, not {len(links)} times"
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    undated = [
        s.splitlines()[0]
        for s in sections
        if not s.startswith("Contents") and "not run" not in s.splitlines()[0] and not re.search(r"20\d\d-\d\d-\d\d", s)
    ]
    assert not undated, f"sections of {B} without a date: {undated}"


def _quoting_files() -> list[str]:
    files = [README, "Makefile", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]
    return files + [str(p.relative_to(ROOT)) for p in sorted((ROOT / "training" / "configs").glob("*.yaml"))]


GOAL = r"\b[Gg]oals?\b(?!\s+(?:is|are)\s+(?:not\s+)?(?:met|unmet))[^.\n]{0,60}?"  # "goal ... 1.3x / 1.05x / 1.05x"


def test_every_stated_goal_is_a_current_goal():
    """A goal of three ratios anywhere in the docs and configs is the one-network or the two-expert goal."""
    goals = {tuple(_source_values(HEADLINES[k])) for k in ("demo goal", "two-expert goal")}
    goals = {tuple(str(Decimal(v).normalize()) for v in g) for g in goals}
    stray = []
    for rel in _quoting_files():
        for m in re.finditer(GOAL + X3, _text(rel) or "", FLAGS):
            if tuple(str(Decimal(v).normalize()) for v in _numbers(m)) not in goals:
                stray.append(f"{rel}: {m.group(0)!r}")
    assert not stray, "goals that are not a current goal:\n" + "\n".join(stray)


def test_every_make_demo_experts_time_is_the_measured_one():
    """Any line naming `make demo-experts` and a time in minutes states the measured range (or a number in it)."""
    lo, hi = _source_values(HEADLINES["make demo-experts time (min)"])
    stray = []
    for rel in [README, "Makefile", "docs/benchmarks.md", "docs/training.md", "docs/ARCHITECTURE.md"]:
        for line in (_text(rel) or "").splitlines():
            if "demo-experts" not in line:
                continue
            for m in re.finditer(r"(\d+)(?:-(\d+))? min\b", line):
                a, b = m.group(1), m.group(2) or m.group(1)
                same = (a, b) == (lo, hi) if m.group(2) else int(lo) <= int(a) <= int(hi)
                if not same:
                    stray.append(f"{rel}: {line.strip()!r}")
    assert not stray, f"make demo-experts times other than {lo}-{hi} min:\n" + "\n".join(stray)
