"""The tiny byte-level BPE tokenizer (a few hundred tokens, trained on the spot from a small corpus, with a chat
template) that the random-weight models of the benches and the tests' tiny models share."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "Context: the order 1234 was shipped on Monday and is in transit.",
    "Question: what should the agent do next? Answer Yes or No.",
    "Proposed answer: tell the customer the order is on its way.",
    "Proposed answer: cancel the order and issue a refund.",
    "Proposed answer: ask the warehouse to check the stock.",
    "Is this proposed answer correct? Yes No A B C D",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "héllo wörld ünïcode ✓ — emoji 🙂 text",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|marker|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", additional_special_tokens=["<|marker|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast
