"""One synthetic paper group as data: its papers' sections with the planted evidence paragraphs,
and the queries that ask for them (`envs.synth` renders and parses them; the vocabulary is
`envs.synth_words`)."""

from __future__ import annotations

import random

import msgspec

from rlmtrain.envs.synth_words import (
    AREAS,
    CONCLUSION,
    DISCUSSION,
    INSTITUTES,
    INTRO,
    LIMITATIONS,
    METHOD,
    NAME_HEADS,
    NAME_TAILS,
    SURNAMES,
    WEAKNESSES,
    Area,
    Metric,
    words,
)

__all__ = ["PaperSpec", "QuerySpec", "paper_group", "paper_spec", "queries_for"]


class PaperSpec(msgspec.Struct, kw_only=True):
    id: str
    title: str
    authors: str
    method: str
    technique: str
    datasets: list[str]
    sections: list[tuple[str, list[str]]]
    """(heading, paragraphs); heading "" = the abstract."""
    evidence: dict[str, str]
    """Evidence kind ("datasets", "baselines", "limitation", "results:<dataset>") -> paragraph."""
    two_columns: bool
    metadata_title: bool


def _fill(template: str, **words: str) -> str:
    return template.format(**words)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


_MINOR_WORDS = frozenset(
    words("a | an | and | as | at | by | for | in | of | on | or | the | to | with")
)


def _title_case(text: str) -> str:
    words = text.split(" ")
    return " ".join(
        w if (i and w in _MINOR_WORDS) or not w[:1].islower() else _cap(w)
        for i, w in enumerate(words)
    )


def _sentences(
    rng: random.Random, pool: tuple[str, ...], k: int, parts: int, **words: str
) -> list[str]:
    """`parts` paragraphs of `k` distinct sentences drawn from `pool` without repeats."""
    drawn = [_fill(s, **words) for s in rng.sample(pool, k * parts)]
    return [" ".join(drawn[i * k : (i + 1) * k]) for i in range(parts)]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _score(rng: random.Random, metric: Metric, strength: float) -> float:
    """A plausible score; strength in [0, 1] moves it towards the metric's good end."""
    lo, hi = metric.low, metric.high
    value = lo + (hi - lo) * (0.25 + 0.6 * strength + rng.uniform(-0.08, 0.08))
    value = value if metric.higher_is_better else hi + lo - value
    return round(value, 3 if hi < 1 else 1)


def paper_spec(
    rng: random.Random, area: Area, paper_id: str, method: str, technique: str
) -> PaperSpec:
    datasets = rng.sample(area.datasets, rng.randint(2, 3))
    baselines = rng.sample(area.baselines, rng.randint(3, 4))
    # Every area has >= 5 datasets and >= 6 baselines, so two others always remain.
    others = [d for d in area.datasets if d not in datasets]
    other_baselines = [b for b in area.baselines if b not in baselines]
    words = dict(
        Method=method, technique=technique, task=area.task, Task=_cap(area.task), field=area.field
    )
    title = f"{method}: {_title_case(technique)} for {_title_case(area.task)}"
    authors = ", ".join(f"{rng.choice('ABCDEGHJKLMNPRST')}. {s}" for s in rng.sample(SURNAMES, 3))
    authors += f" ({rng.choice(INSTITUTES)})"
    metric = area.metric
    abstract = (
        f"We present {method}, an approach to {area.task} that builds on {technique}. "
        f"Unlike prior systems, {method} keeps training simple and adds no inference passes. "
        f"Experiments on {_join(datasets)} show consistent improvements in {metric.name} "
        "over strong baselines, and ablations isolate where the gains come from."
    )
    intro = _sentences(rng, INTRO, 3, 3, **words)
    discussion = _sentences(rng, DISCUSSION, 4, 2, **words)
    related = [
        f"Research on {area.task} has a long history in {area.field}. Surveys of the area "
        "distinguish methods by how they trade model capacity against the cost of training, "
        "and by how much supervision they need. We focus on the recent line of neural approaches.",
        f"Earlier work on {area.task} includes {_join(rng.sample(other_baselines, 2))}. "
        f"Many of these studies report results on {_join(rng.sample(others, 2))}, "
        "but comparisons are rarely made under matched budgets. "
        f"Approaches based on {rng.choice([t for t in area.techniques if t != technique])} "
        "are closest in spirit to ours, although they target a different trade-off.",
    ]
    method_paras = _sentences(rng, METHOD, 3, 2, **words)
    method_paras.append(
        f"We implement {method} in PyTorch and train it for {rng.choice([30, 50, 100, 200])} "
        f"epochs with AdamW, a learning rate of {rng.choice(['1e-3', '5e-4', '3e-4', '1e-4'])} "
        f"and a batch size of {rng.choice([32, 64, 128, 256])}. Training takes about "
        f"{rng.randint(3, 40)} hours on {rng.choice(['one', 'four', 'eight'])} GPUs, and "
        "all hyperparameters are chosen on the validation split of each benchmark."
    )
    evidence: dict[str, str] = {}
    evidence["datasets"] = (
        f"We evaluate {method} on {len(datasets)} public benchmarks: {_join(datasets)}. "
        f"For every dataset we use the standard splits and report {metric.name} averaged "
        f"over {rng.choice(['three', 'five'])} runs with different seeds."
    )
    evidence["baselines"] = (
        f"We compare {method} against the following baselines: {_join(baselines)}. "
        "All baselines are re-trained with the authors' public code and the same budget, "
        "so that the differences reflect the methods rather than the tuning effort."
    )
    results = []
    for rank, dataset in enumerate(datasets):
        ours = _score(rng, metric, rng.uniform(0.75, 1.0))
        best_baseline = rng.choice(baselines)
        theirs = _score(rng, metric, rng.uniform(0.3, 0.7))
        if (theirs > ours) == metric.higher_is_better:
            ours, theirs = theirs, ours
        second = rng.choice([b for b in baselines if b != best_baseline])
        paragraph = (
            f"On {dataset}, {method} reaches a {metric.name} of {ours}, while the strongest "
            f"baseline, {best_baseline}, reaches {theirs}. {second} is further behind, "
            f"which we attribute to its weaker handling of {rng.choice(WEAKNESSES)}."
        )
        evidence[f"results:{dataset}"] = paragraph
        results.append(paragraph)
        if rank == 0:
            results.append(
                f"Across all benchmarks, the improvement of {method} is largest where {technique} "
                "has the most room to act; the appendix lists per-seed numbers."
            )
    probe = rng.choice(datasets)
    results.append(
        f"Ablation. Removing {technique} from {method} costs "
        f"{round(rng.uniform(0.4, 3.5), 1)} points of {metric.name} on {probe}, and replacing it "
        "with a standard component recovers only part of the gap. The other components matter "
        "less: each accounts for under one point on every benchmark."
    )
    first, second = rng.choice(LIMITATIONS)
    lim_words = dict(x=str(rng.choice([2, 3, 4])), b=rng.choice(baselines), t=technique)
    evidence["limitation"] = (
        f"A limitation of {method} is that {_fill(first, **lim_words)}. "
        + _fill(second, **lim_words)
    )
    conclusion = [" ".join(_fill(s, **words) for s in CONCLUSION)]
    sections = [
        ("", [abstract]),
        ("1 Introduction", intro),
        ("2 Related Work", related),
        ("3 Method", method_paras),
        ("4 Experimental Setup", []),
        ("4.1 Datasets", [evidence["datasets"]]),
        ("4.2 Baselines", [evidence["baselines"]]),
        ("5 Results", results),
        ("6 Discussion", discussion),
        ("7 Limitations", [evidence["limitation"]]),
        ("8 Conclusion", conclusion),
    ]
    return PaperSpec(
        id=paper_id,
        title=title,
        authors=authors,
        method=method,
        technique=technique,
        datasets=datasets,
        sections=sections,
        evidence=evidence,
        two_columns=rng.random() < 0.5,
        metadata_title=rng.random() < 0.5,
    )


class QuerySpec(msgspec.Struct, kw_only=True):
    kind: str
    query: str
    evidence: list[tuple[str, str]]
    """(paper id, evidence kind) pairs."""


def queries_for(rng: random.Random, area: Area, papers: list[PaperSpec]) -> list[QuerySpec]:
    n = len(papers)

    def selective(groups: dict[str, list[PaperSpec]]) -> list[str]:
        # A multi-paper query must leave some paper out; a one-paper group has only that paper.
        return sorted(k for k, members in groups.items() if n == 1 or len(members) < n)

    by_technique: dict[str, list[PaperSpec]] = {}
    by_dataset: dict[str, list[PaperSpec]] = {}
    for paper in papers:
        by_technique.setdefault(paper.technique, []).append(paper)
        for dataset in paper.datasets:
            by_dataset.setdefault(dataset, []).append(paper)
    makers = []
    if techniques := selective(by_technique):
        t = rng.choice(techniques)
        members = by_technique[t]
        makers.append(
            QuerySpec(
                kind="baselines",
                query=f"Which baselines are used to evaluate the methods based on {t}?",
                evidence=[(p.id, "baselines") for p in members],
            )
        )
        t2 = rng.choice(techniques)
        makers.append(
            QuerySpec(
                kind="limitation",
                query=f"What limitations are reported for approaches that rely on {t2}?",
                evidence=[(p.id, "limitation") for p in by_technique[t2]],
            )
        )
    if datasets := selective(by_dataset):
        d = rng.choice(datasets)
        makers.append(
            QuerySpec(
                kind="results",
                query=f"Which method achieves the best {area.metric.name} on {d}?",
                evidence=[(p.id, f"results:{d}") for p in by_dataset[d]],
            )
        )
    paper = rng.choice(papers)
    makers.append(
        QuerySpec(
            kind="datasets",
            query=f"Which datasets are used to evaluate {paper.method}?",
            evidence=[(paper.id, "datasets")],
        )
    )
    rng.shuffle(makers)
    return makers[: rng.randint(1, 3)]


def paper_group(
    rng: random.Random, group: int, max_papers: int = 10
) -> tuple[Area, list[PaperSpec], list[QuerySpec]]:
    area = rng.choice(AREAS)
    n = rng.choice((1, 2, 3)) if rng.random() < 0.15 else rng.randint(4, 10)
    n = min(n, max_papers)
    heads = rng.sample(NAME_HEADS, n)
    tails = [rng.choice(NAME_TAILS) for _ in range(n)]
    techniques = rng.sample(area.techniques, max(1, min(len(area.techniques), (n + 1) // 2)))
    papers = [
        paper_spec(rng, area, f"g{group:04d}-p{k}", heads[k] + tails[k], rng.choice(techniques))
        for k in range(n)
    ]
    return area, papers, queries_for(rng, area, papers)
