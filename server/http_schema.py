"""The HTTP front door's request bodies, shaped exactly like the peers' so that their clients work unchanged:
SGLang's `ScoringRequest` (/v1/score), vLLM's `GenerativeScoringRequest` (/generative_scoring), its rerank, score
and classify requests, OpenAI's completion and chat-completion requests, and vLLM's /tokenize. pydantic, strict (a
string is not a number, 1 is not `true`), unknown fields ignored as the peers ignore them. pyscore's own extras are
optional fields the peers' clients never send. Fields a peer accepts but pyscore cannot honour are refused by the
handlers, naming the field, never silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class CacheOptions(Body):
    """pyscore's prefix-cache controls (vLLM's `cache_salt` is taken as `prefix_cache_salt`)."""

    prefix_cache_salt: str | None = None
    cache_salt: str | None = None
    bypass_prefix_cache: bool = False

    def salt(self) -> str:
        return self.prefix_cache_salt or self.cache_salt or ""


class ScoringBody(CacheOptions):
    """SGLang's ScoringRequest: scores come back [item][label] (setwise: [item][row][label]). `query` and `items`
    are optional here as in SGLang's schema; the handler refuses what SGLang's scoring refuses (no items, one string
    for items, no query)."""

    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None
    # pyscore's extras
    labels: list[str] | None = None
    mode: Literal["auto", "sis", "mis"] = "auto"
    score_extraction_token: str | None = None


class GenerativeScoringBody(CacheOptions):
    """vLLM's GenerativeScoringRequest: one score per item, the first label's probability."""

    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    model: str | None = None
    priority: int = 0  # accepted, as vLLM does without a priority scheduler; pyscore serves in arrival order
    request_id: str | None = None


class PoolingOptions(CacheOptions):
    """What vLLM's rerank, score and classify requests share; fields pyscore cannot honour are refused by the
    handler when set (`refuse_unserved`). Truncation keeps a prompt's last tokens (server/http_rerank.py)."""

    model: str | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0  # accepted, as vLLM does without a priority scheduler; pyscore serves in arrival order
    use_activation: bool | None = None  # None: vLLM's default, on
    truncate_prompt_tokens: int | None = None  # -1: the model's context
    truncation_side: Literal["left", "right"] | None = None  # None and "left" keep the last tokens; "right" refused
    # pyscore's extras (causal LMs: the labels whose label softmax gives the relevance, positive first;
    # classifiers with several classes: the class whose score is the relevance)
    labels: list[str] | None = None
    label_token_ids: list[int] | None = None

    def unserved(self) -> dict[str, Any]:
        """Fields set that pyscore does not serve (each refused by name)."""
        return {}


class ScoringPairOptions(PoolingOptions):
    """vLLM's ScoringRequestMixin: per-side truncation (0: off; a side's last tokens kept) is served, the score
    template's instruction is not."""

    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unserved(self) -> dict[str, Any]:
        return {"instruction": self.instruction, "chat_template_kwargs": self.chat_template_kwargs}


class RerankBody(ScoringPairOptions):
    """vLLM's RerankRequest (its /rerank, /v1/rerank, /v2/rerank: Jina's and Cohere's shape)."""

    query: str
    documents: str | list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document


PairSide = str | list[str]


class VLLMScoreBody(ScoringPairOptions):
    """vLLM's ScoreRequest: one of its four spellings of the two sides (queries + documents, queries + items,
    data_1 + data_2, text_1 + text_2), each side one text or a list (1:1, 1:N or N:N)."""

    queries: PairSide | None = None
    documents: PairSide | None = None
    items: PairSide | None = None
    data_1: PairSide | None = None
    data_2: PairSide | None = None
    text_1: PairSide | None = None
    text_2: PairSide | None = None


class ClassifyBody(PoolingOptions):
    """vLLM's ClassificationRequest: its completion form (`input`) or its chat form (`messages` under the model's
    chat template, vLLM's ClassificationChatRequest); the handler takes one of the two."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for `input`, false for `messages`
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class StreamOptions(Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far (with include_usage)


class SamplingBody(CacheOptions):
    """What OpenAI's completion and chat requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0 = off
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: ids that end a choice (its stop_reason names the one)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    use_beam_search: bool = False  # vLLM's; beam search is not served, so true is refused by name
    # vLLM's sampling extras pyscore does not serve: a value other than vLLM's default is refused by name
    # (http_openai.refuse_unsupported), never ignored
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = 1.0


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top alternatives per token (OpenAI allows up to 5; pyscore up to 20)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension: choices[].prompt_logprobs with this many alternatives
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: the response's top-level prompt_logprobs
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class SGLangSamplingParams(Body):
    """SGLang's sampling_params for /generate (its defaults: 128 new tokens, temperature 1)."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    stop: str | list[str] | None = None
    sampling_seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True


class SGLangGenerateBody(CacheOptions):
    """SGLang's native GenerateReqInput, the fields pyscore serves: one prompt or a batch (`text`, or `input_ids`),
    sampling_params (one for all, or one per prompt), return_logprob with logprob_start_len / top_logprobs_num /
    return_text_in_logprobs, stream (one prompt)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: the generated tokens' logprobs only
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


class TokenizeBody(Body):
    """vLLM's /tokenize (SGLang's takes the same `prompt`)."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False
    model: str | None = None


class TokenizeChatBody(Body):
    """vLLM's /tokenize of a chat: the messages rendered with the model's chat template (its defaults: the
    generation prompt added, no special tokens beyond the template's)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused: the model's own template is the one served
    tools: list[Any] | None = None  # refused, as in chat completions
    model: str | None = None


class DetokenizeBody(Body):
    """vLLM's /detokenize."""

    tokens: list[int]
    model: str | None = None
