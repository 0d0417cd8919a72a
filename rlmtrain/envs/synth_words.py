"""The vocabulary of the synthetic evidence corpus (`envs.synth`): research areas with their
task, datasets, metric, baselines and techniques, and the sentence pools every paper draws from.

Data only, kept apart from the generator so that the tables can grow without the code around
them moving.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "AREAS",
    "Area",
    "CONCLUSION",
    "DISCUSSION",
    "INSTITUTES",
    "INTRO",
    "LIMITATIONS",
    "METHOD",
    "Metric",
    "NAME_HEADS",
    "NAME_TAILS",
    "SURNAMES",
    "WEAKNESSES",
    "words",
]


class Metric(msgspec.Struct, frozen=True):
    name: str
    higher_is_better: bool
    low: float
    high: float


class Area(msgspec.Struct, frozen=True):
    field: str
    task: str
    datasets: tuple[str, ...]
    metric: Metric
    baselines: tuple[str, ...]
    techniques: tuple[str, ...]


def words(text: str) -> tuple[str, ...]:
    """'a | b | c' -> ('a', 'b', 'c'): keeps the vocabulary table compact and readable."""
    return tuple(word.strip() for word in text.split("|"))


# fmt: off
AREAS = (
    Area(
        field="graph learning", task="node classification on graphs",
        datasets=words("Cora | CiteSeer | PubMed | ogbn-arxiv | Amazon-Photo | Coauthor-CS"),
        metric=Metric("accuracy", True, 62.0, 88.0),
        baselines=words("GCN | GAT | GraphSAGE | APPNP | GIN | SGC"),
        techniques=words("spectral filtering | neighbourhood attention | random-walk sampling | "
                          "contrastive pre-training | label propagation | virtual nodes"),
    ),
    Area(
        field="machine translation", task="neural machine translation",
        datasets=words("WMT14 En-De | WMT16 En-Ro | IWSLT14 De-En | FLORES-101 | OPUS-100"),
        metric=Metric("BLEU", True, 24.0, 38.0),
        baselines=words("Transformer-base | ConvS2S | mBART | LightConv | Marian | DynamicConv"),
        techniques=words("back-translation | knowledge distillation | "
                          "relative position encoding | shared subword vocabularies | "
                          "curriculum sampling | adapter layers"),
    ),
    Area(
        field="computer vision", task="semantic segmentation",
        datasets=words("ADE20K | Cityscapes | PASCAL VOC 2012 | COCO-Stuff | Mapillary Vistas"),
        metric=Metric("mIoU", True, 38.0, 82.0),
        baselines=words("DeepLabv3+ | PSPNet | SegFormer | UPerNet | Mask2Former | HRNet"),
        techniques=words("multi-scale feature fusion | boundary refinement | "
                          "query-based decoding | self-training with pseudo-labels | "
                          "dilated convolutions | token pruning"),
    ),
    Area(
        field="speech processing", task="automatic speech recognition",
        datasets=words("LibriSpeech test-clean | LibriSpeech test-other | TED-LIUM 3 | "
                        "Common Voice | Switchboard"),
        metric=Metric("word error rate", False, 2.0, 14.0),
        baselines=words("wav2vec 2.0 | Conformer | Jasper | QuartzNet | ContextNet | "
                         "Whisper-small"),
        techniques=words("SpecAugment | CTC alignment | noisy student training | "
                          "streaming chunk attention | language model fusion | "
                          "subword regularisation"),
    ),
    Area(
        field="forecasting", task="long-horizon time-series forecasting",
        datasets=words("ETTh1 | ETTm2 | Electricity | Traffic | Weather | Exchange"),
        metric=Metric("mean squared error", False, 0.15, 0.65),
        baselines=words("Informer | Autoformer | FEDformer | DLinear | PatchTST | N-BEATS"),
        techniques=words("patch embeddings | seasonal-trend decomposition | "
                          "frequency-domain mixing | channel independence | "
                          "reversible normalisation | sparse attention"),
    ),
    Area(
        field="natural language processing", task="open-domain question answering",
        datasets=words("Natural Questions | TriviaQA | HotpotQA | SQuAD 2.0 | WebQuestions"),
        metric=Metric("exact match", True, 28.0, 72.0),
        baselines=words("BERT-large | DPR | FiD | RAG | ColBERT | REALM"),
        techniques=words("dense passage retrieval | reranking with cross-encoders | "
                          "query rewriting | evidence aggregation | hard negative mining | "
                          "retrieval-augmented decoding"),
    ),
    Area(
        field="recommender systems", task="top-k recommendation",
        datasets=words("MovieLens-1M | Amazon-Books | Yelp2018 | Gowalla | Last.fm"),
        metric=Metric("NDCG@20", True, 0.05, 0.42),
        baselines=words("LightGCN | NGCF | SASRec | BPR-MF | BERT4Rec | MultVAE"),
        techniques=words("graph collaborative filtering | sequential self-attention | "
                          "contrastive view augmentation | popularity debiasing | "
                          "negative sampling by hardness | knowledge graph side information"),
    ),
    Area(
        field="computational chemistry", task="molecular property prediction",
        datasets=words("QM9 | ZINC | Tox21 | ESOL | FreeSolv | BBBP"),
        metric=Metric("mean absolute error", False, 0.08, 0.9),
        baselines=words("SchNet | DimeNet | MPNN | AttentiveFP | GROVER | PaiNN"),
        techniques=words("equivariant message passing | 3D conformer encoding | "
                          "motif-level pooling | self-supervised masking | "
                          "substructure counting | edge-featured transformers"),
    ),
)

LIMITATIONS = (
    (
        "it needs roughly {x} times more memory than {b} during training",
        "This restricts the batch sizes we could use on a single accelerator.",
    ),
    (
        "its gains shrink on small datasets, where it can overfit without strong regularisation",
        "On the smallest benchmark the margin over {b} is within one standard deviation.",
    ),
    (
        "the {t} stage adds about {x} times the inference latency of {b}",
        "Deployments with strict latency budgets may therefore prefer simpler models.",
    ),
    (
        "we only tested it on English-centric or curated benchmarks",
        "Whether the improvements carry over to noisier, real-world data remains open.",
    ),
    (
        "its hyperparameters were tuned per dataset and it is sensitive to the learning rate",
        "A poorly chosen schedule erased most of the improvement over {b} in our ablation.",
    ),
    (
        "the analysis assumes the training and test distributions match",
        "Under distribution shift the advantage of {t} was not consistent.",
    ),
)

INTRO = (
    "{Task} remains a central problem in {field}, with applications well beyond the benchmarks.",
    "Progress in {field} has been driven by larger models, better data and stronger objectives.",
    "Yet most systems for {task} still trade accuracy against cost in poorly understood ways.",
    "Practitioners report that small changes to the training recipe often matter more.",
    "In this paper we revisit {task} from the perspective of {technique}.",
    "Our goal is a method that is simple to implement and competitive across settings.",
    "We release code and trained models to make the comparison easy to reproduce.",
    "The remainder of the paper describes the method, the experimental protocol and the results.",
    "Several recent studies question whether reported gains in {field} survive careful tuning.",
    "We therefore pay particular attention to matching the budgets of all compared systems.",
)

METHOD = (
    "{Method} is built around {technique}, which we apply at every stage of the model.",
    "The design keeps the number of parameters close to that of standard models for {task}.",
    "Training uses a single objective and no task-specific heuristics.",
    "We found that initialising the new components to the identity stabilises early training.",
    "At inference time {Method} requires no additional passes over the input.",
    "The main hyperparameters are the depth, the hidden width and the strength of {technique}.",
    "We describe each component in turn and discuss the choices that mattered most.",
)

DISCUSSION = (
    "The gains of {Method} are not uniform, and it is worth asking where they come from.",
    "One explanation is that {technique} acts as a regulariser as much as a modelling choice.",
    "A second is that the compared systems were tuned for other settings in {field}.",
    "We controlled for the second by re-running every system under one protocol.",
    "The per-seed variance of {Method} is similar to that of the other systems.",
    "Qualitatively, the errors that {Method} removes are concentrated on harder inputs.",
    "We also observed that larger models benefit less from {technique} than smaller ones.",
    "This is consistent with reports that scale can substitute for inductive bias in {field}.",
    "Finally, the cost of {technique} is modest compared with the rest of the pipeline.",
    "We expect the same pattern to hold for related problems beyond {task}.",
)

CONCLUSION = (
    "We presented {Method}, an approach to {task} based on {technique}.",
    "The results suggest that {technique} is an effective and inexpensive ingredient.",
    "Future work will study larger scales and other problems in {field}.",
    "We hope the released code helps others build on these findings.",
)

WEAKNESSES = words("long inputs | rare classes | noisy labels | scale variation")
NAME_HEADS = words("Hyper | Sparse | Meta | Flow | Neuro | Cross | Deep | Quant | Astra | "
                     "Lumen | Vector | Prism | Orbit | Nova | Echo | Pulse | Fuse | Stride")
NAME_TAILS = words("Net | Former | Mix | Prop | Align | Gate | Shift | Lens | Path | Fold | "
                     "Bridge | Weave | Scope | Forge | Loop | Core")
SURNAMES = words("Moreau | Tanaka | Okafor | Lindqvist | Silva | Kowalski | Nguyen | Haddad | "
                   "Fischer | Petrov | Rossi | Andersen | Kim | Mensah | Dubois | Ivanova")
INSTITUTES = words("Institute of Applied Computing | Department of Computer Science | "
                     "Centre for Machine Intelligence | School of Informatics | "
                     "Research Lab for AI")
# fmt: on
