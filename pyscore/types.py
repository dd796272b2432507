"""Plain request/result types of the engine API. No torch, no gRPC: the servicer converts protobuf to and
from these, the engine consumes and produces them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["auto", "sis", "mis"]

# Generation's fixed caps (pyscore.generation validates them; the server also counts stop strings and stop token
# ids at the door, before a request's list is copied into each of its choices).
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 128  # a model's end ids are a handful; the cap keeps a list from growing with the body limit


class Boundary(enum.Enum):
    """What a forward pass does at a layer boundary, as its owner decides (Engine.set_boundary): go on, STOP there
    (PassInterrupted; nothing of the pass is committed), or YIELD: run the owner's other work there (other passes
    over their own tensors), then go on from the same layer."""

    CONTINUE = "continue"
    STOP = "stop"
    YIELD = "yield"


@dataclass
class ScoreRequest:
    """query and items are text or token ids (not mixed). Labels: label_token_ids or labels (strings that
    must be single tokens); optional for classifiers (then class indices, default all classes)."""

    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int] | None = None
    labels: list[str] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    score_extraction_token: str | None = None
    mode: Mode = "auto"
    bypass_prefix_cache: bool = False  # neither read nor write the prefix cache (cold timings)
    prefix_cache_salt: str = ""  # requests with different salts never share cached blocks


@dataclass
class Usage:
    prompt_tokens: int = 0  # tokens of all query+item sequences as SIS would see them
    computed_tokens: int = 0  # tokens actually run through the model (MIS computes the query once)
    cached_tokens: int = 0  # query / prompt tokens read from the prefix cache instead of computed
    # Server-side timing (0 in process), a measurement rather than part of the answer: not compared by ==.
    queue_s: float = field(default=0.0, compare=False)  # admission to the first forward pass that included it
    compute_s: float = field(default=0.0, compare=False)  # wall time of the passes that included it (shared)


@dataclass
class ScoreResult:
    """scores[i] is item i's rows (pointwise: one row; setwise: one per marker); each row has one float per
    label in `label_token_ids` order (for classifiers: per class index)."""

    scores: list[list[list[float]]]
    label_token_ids: list[int]
    mode: Literal["sis", "mis"]
    usage: Usage = field(default_factory=Usage)


@dataclass
class GenerateRequest:
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    apply_chat_template: bool = False
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # Ids that end the generation as an end-of-sequence id does (vLLM's stop_token_ids): the token joins neither
    # text nor token_ids; the result's stop_token holds it. Not in pyscore.v1's GenerateRequest (the HTTP routes').
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    bypass_prefix_cache: bool = False  # neither read nor write the prefix cache (cold timings)
    prefix_cache_salt: str = ""  # requests with different salts never share cached blocks
    # Set: the logprob of every prompt token from prompt_logprobs_start on given the tokens before it, with this
    # many alternatives (0 to 20); the prompt is computed from the token before the start on (the prefix cache may
    # serve the blocks before it). max_tokens may then be 0: the prompt's logprobs alone.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: Literal["length", "stop", "eos"]
    usage: Usage = field(default_factory=Usage)  # prompt_tokens, computed = prompt - cached + generated
    # With GenerateRequest.prompt_logprobs: one entry per prompt token from prompt_logprobs_start on; the first
    # prompt token's logprob is NaN (nothing precedes it) and it has no alternatives.
    prompt_logprobs: list[TokenLogprob] | None = None
    # The token that ended the generation and joined neither text, token_ids nor logprobs: an end-of-sequence id
    # (finish "eos") or one of the request's stop_token_ids ("stop"), with its logprob entry (alternatives as
    # asked). vLLM lists it last in a choice's logprobs and counts it; gRPC's Generate does neither.
    stop_token: TokenLogprob | None = None
    stop_string: str | None = None  # the stop string that ended it (finish "stop"), as in the request

    @property
    def stopped_by(self) -> str | int | None:
        """What ended it: the stop string, else the stop token's id (an end-of-sequence id included), else None."""
        if self.stop_string is not None:
            return self.stop_string
        return None if self.stop_token is None else self.stop_token.token_id


@dataclass
class ServerLimits:
    """A server's limits on one request (0 = none); see pyscore.v1.ServerLimits."""

    max_items: int = 0
    max_request_tokens: int = 0
    max_batch_tokens: int = 0
    max_message_bytes: int = 0
    max_queue: int = 0


@dataclass
class MemoryPlan:
    """What the served model takes in memory, in bytes (see pyscore.v1.MemoryPlan and pyscore.memory): the weights,
    the pools it grows into under load, one pass's activations and the runtime; their sum sizes a pod."""

    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_budget_bytes: int = 0  # the KV store: prefix cache and running generations (--kv-cache-mb)
    linear_state_bytes: int = 0  # hybrid models: max_running_generations x the per-sequence recurrent state
    prefix_cache_bytes: int = 0  # 0: the prefix cache lives in the KV store (kv_budget_bytes)
    activation_bytes: int = 0  # an estimate of one forward pass at max_batch_tokens
    runtime_bytes: int = 0
    # What the machine / cgroup / GPU had free when the model was loaded (0: unknown): a measurement of the moment,
    # not part of the plan, so not compared by ==.
    available_bytes: int = field(default=0, compare=False)

    @property
    def expected_total_bytes(self) -> int:
        return (self.weight_bytes + self.kv_budget_bytes + self.linear_state_bytes + self.prefix_cache_bytes
                + self.activation_bytes + self.runtime_bytes)


@dataclass
class ModelInfo:
    name: str
    architecture: str
    kind: Literal["causal_lm", "classifier"]
    vocab_size: int
    max_context: int
    dtype: str
    device: str
    special_tokens: dict[str, str]
    num_labels: int = 0  # classifiers: number of classes
    ops: dict[str, str] = field(default_factory=dict)  # op -> the path it takes and why ("kernel: pyscore._C (...)")
    limits: ServerLimits | None = None  # set by a server (the engine has none)
    prefix_cache_block_tokens: int = 0  # the prefix cache's block (0: no prefix cache)
    prefix_cache_bytes: int = 0  # its byte budget
    cpu_tier: str = ""  # CPU models: the tier the CPU kernels run (pyscore/ops/tiers.py), "" elsewhere
    memory: MemoryPlan | None = None  # what the model takes in memory (None: not known, e.g. a fake engine)
    server_version: str = ""  # set by a server: its pyscore.__version__
    quantize: str = ""  # "int8": the layers' projections in int8 W8A8 (dtype names the rest); "" none
