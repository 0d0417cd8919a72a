"""Evidence selection (docs/algorithm.md §2): quote the passages of papers that answer a query.

The REPL's `context` is a dict paper id -> {"title", "abstract", "text"}, the text parsed from
PDF (noisy on purpose); the tools are `evidence_tools`. A task names its papers and its gold
evidence spans (paper id, char offsets into the parsed text, the text itself); the papers live in
a corpus JSONL (`envs.pdf.Paper` lines), by convention `corpus.jsonl` beside the task file.

The system prompt carries both strategies of the seed: a single paper is searched with keyword
variants, refined and answered with `extract_section` in 5-7 turns; a group of papers is
triaged by the root, which sends one child per promising paper through `rlm_query_batched` and
joins the children's passages. A child's `context` is a one-paper dict, so it follows the
single-paper strategy with the same prompt.

Reward: the character n-gram span F1 of the root's answer against the gold spans
(`rewards.span_f1`), or the rubric judge's score when the env is built with one (its failures
fall back or drop per `JudgeConfig.on_unscored`, never a silent 0). A root without an answer
scores 0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmtrain.envs.base import Env, RewardResult, read_tasks, register_env, root_answers
from rlmtrain.envs.evidence_tasks import EvidenceSpan, EvidenceTask

if TYPE_CHECKING:
    from rlmtrain.config import Config, RolloutConfig
    from rlmtrain.envs.pdf import Paper
    from rlmtrain.rewards.judge import RubricJudge
    from rlmtrain.rlm.records import RolloutGroup

__all__ = ["COMPACT_STRATEGY", "EVIDENCE_STRATEGY", "EvidenceEnv", "EvidenceSpan", "EvidenceTask"]

CORPUS_FILE = "corpus.jsonl"


EVIDENCE_STRATEGY = """\
You select evidence from scientific papers. `context` is a dict mapping paper id -> \
{"title", "abstract", "text"}; the text was parsed from PDF, so expect broken lines, running \
headers and odd spacing. Answer the query with the passages of the papers that answer it, \
quoted verbatim, each on its own line as "[paper id] passage". Quote whole sentences and \
nothing that does not bear on the query.

Strategy when `context` holds one paper (about 5-7 turns):
1. list_papers(context) to see the paper, then search its text with several keyword variants \
taken from the query (singular and plural, synonyms, the names it mentions) and print the \
snippets;
2. search again around the most promising snippets (a more specific phrase, a larger window) \
to see where the passage begins and ends;
3. cut each passage out with extract_section(snippet, first words, last words) and finish \
with FINAL_VAR on the variable holding the answer.

Strategy when `context` holds several papers:
1. list_papers(context) and search(context, keyword) with a few keyword variants to see which \
papers mention what the query asks about; not every paper is relevant;
2. for each paper worth reading, build a prompt from get_paper_abstract(context, paper_id) \
and the query, and send all of them at once with rlm_query_batched(prompts, \
[{paper_id: context[paper_id]} for each such paper]); each helper quotes the passages of its \
one paper;
3. join the helpers' non-empty answers, each prefixed with its paper id, and finish with \
FINAL_VAR."""

CODE_WEIGHT = 20
"""How many times the teacher's code counts in the tokenizer's training text."""

COMPACT_STRATEGY = """\
Quote the passages of the papers in `context` (id -> {"title", "abstract", "text"}) that \
answer `query`. Tools: search(text, phrase, window, bidirectional) -> sentences around each hit \
({id: [...]} for a dict); extract_section(snippet, start, end); list_papers(context); \
get_paper_abstract(context, id).
Several papers: one helper per paper whose abstract names what the query is about, \
rlm_query_batched([query] * n, [{id: context[id]}, ...]); join their answers.
One paper: search the words that open the answer; answer with what you found."""


class EvidenceEnv(Env):
    name = "evidence"
    task_type = EvidenceTask

    def __init__(
        self,
        corpus: dict[str, Paper] | None = None,
        *,
        judge: RubricJudge | None = None,
        prompt_style: str = "full",
        flawed_share: float = 0.0,
    ):
        if prompt_style not in ("full", "compact"):
            raise ValueError(f"prompt_style must be 'full' or 'compact', got {prompt_style!r}")
        self.corpus: dict[str, Paper] = dict(corpus or {})
        self.judge = judge
        self.prompt_style = prompt_style
        self.flawed_share = flawed_share
        """The share of the tasks the teacher plays with a flawed plan (`evidence_teacher`)."""

    # -- data -----------------------------------------------------------------------------

    def load_corpus(self, path: str | Path) -> None:
        """Add the papers of a corpus JSONL (later files win on a repeated id)."""
        from rlmtrain.envs.pdf import read_corpus

        self.corpus.update(read_corpus(path))

    def load_tasks(self, path: str | Path) -> list[EvidenceTask]:
        """Read tasks and the `corpus.jsonl` beside them; every paper a task names must exist."""
        path = Path(path)
        corpus_path = path.parent / CORPUS_FILE
        if corpus_path.is_file():
            self.load_corpus(corpus_path)
        tasks = list(read_tasks(path, EvidenceTask))
        for task in tasks:
            missing = [pid for pid in task.paper_ids if pid not in self.corpus]
            if missing:
                raise ValueError(
                    f"{path}: task {task.id!r} names papers not in the corpus "
                    f"({corpus_path}): {', '.join(missing[:5])}"
                )
        return tasks

    # -- the RLM's view -------------------------------------------------------------------

    def system_prompt(self) -> str:
        return COMPACT_STRATEGY if self.prompt_style == "compact" else EVIDENCE_STRATEGY

    def user_prompt(self, task: EvidenceTask, turn: int, max_turns: int) -> str:
        n = len(task.paper_ids)
        papers = "1 paper" if n == 1 else f"{n} papers"
        return f"`context` holds {papers}.\n" + super().user_prompt(task, turn, max_turns)

    def vocabulary_texts(self, tasks: list[EvidenceTask]) -> list[str]:
        """The base texts, the tasks' papers, and the teacher's code for every task (root and
        child plans), so tool names and code idioms get tokens of their own."""
        from rlmtrain.envs.evidence_teacher import compact_child_plan, compact_root_plan
        from rlmtrain.envs.teacher import fenced_code

        papers = {pid: self.corpus[pid] for task in tasks for pid in task.paper_ids}
        texts = super().vocabulary_texts(tasks)
        for paper in papers.values():
            texts += [paper.title, paper.abstract, paper.text]
        # The code is a small share of the text but every completion: weighted up, its idioms
        # become single tokens and a turn's code gets shorter. Fenced as a reply is, so that the
        # fence lines are a token or two rather than ten.
        share = self.flawed_share
        for task in tasks:
            try:
                plans = compact_root_plan(task.query, len(task.paper_ids), share)
                plans += compact_child_plan(task.query, share)
            except ValueError:
                continue  # a query of the user's own the teacher has no plan for: no code
            replies = [fenced_code(code) for code in plans]
            texts += replies * CODE_WEIGHT
        return texts

    def synthesize(self, out_dir: Path, *, groups: int, first_group: int, config: Config) -> Path:
        """The synthetic corpus (`envs.synth`): PDFs rendered and parsed back, and its tasks."""
        from rlmtrain.envs.synth import synthesize

        synthesize(
            out_dir,
            groups=groups,
            seed=config.data.seed,
            first_group=first_group,
            max_papers=config.data.synth_max_papers,
            progress=config.logging.progress,
        )
        return Path(out_dir) / "tasks.jsonl"

    def teacher(self, rollout: RolloutConfig) -> Callable[[str], str]:
        """The scripted teacher's reply (`evidence_teacher`), for `rollout.teaching.teach`."""
        from rlmtrain.envs.evidence_teacher import teacher

        return teacher(rollout, self.flawed_share)

    def context(self, task: EvidenceTask) -> dict[str, dict[str, Any]]:
        out = {}
        for paper_id in task.paper_ids:
            paper = self.corpus.get(paper_id)
            if paper is None:
                raise KeyError(f"task {task.id!r}: paper {paper_id!r} is not in the loaded corpus")
            out[paper_id] = {"title": paper.title, "abstract": paper.abstract, "text": paper.text}
        return out

    def tool_modules(self) -> list[str]:
        return ["rlmtrain.envs.evidence_tools"]

    # -- reward ---------------------------------------------------------------------------

    async def reward(self, task: EvidenceTask, group: RolloutGroup) -> RewardResult:
        answers = root_answers(group)
        truth = [span.text for span in task.evidence]
        if self.judge is not None:
            scores = await self.judge.score_many(task.query, truth, answers)
            return RewardResult(
                scores=[s.score for s in scores],
                details=[{"method": s.method, "reason": s.reason} for s in scores],
            )
        from rlmtrain.rewards.span_f1 import span_f1

        scores = [0.0 if a is None else span_f1(a, truth) for a in answers]
        methods = ["no_answer" if a is None else "span_f1" for a in answers]
        return RewardResult(scores=scores, details=[{"method": m} for m in methods])


@register_env("evidence")
def make_evidence_env(config: Config | None) -> EvidenceEnv:
    """The evidence env of a run: the corpus beside `data.train_path` (and `data.eval_path`)
    when set, and the rubric judge when `judge.base_url` is set."""
    style = config.rollout.prompt_style if config is not None else "full"
    share = config.data.teacher_flawed_share if config is not None else 0.0
    env = EvidenceEnv(judge=_judge(config), prompt_style=style, flawed_share=share)
    if config is not None:
        for tasks_path in (config.data.train_path, config.data.eval_path):
            corpus = Path(tasks_path).parent / CORPUS_FILE if tasks_path else None
            if corpus is not None and corpus.is_file():
                env.load_corpus(corpus)
    return env


def _judge(config: Config | None) -> RubricJudge | None:
    if config is None or not config.judge.base_url:
        return None
    from rlmtrain.rewards.judge import RubricJudge

    return RubricJudge(config.judge)
