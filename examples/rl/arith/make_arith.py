"""Writes this example's inputs: tiny-arith/ (a random Llama with 2 layers, hidden 64, and
a character-level tokenizer saved as a transformers PreTrainedTokenizerFast with a chat
template) and train.jsonl (sums of small numbers with their answers). Built offline with
`tokenizers` and `transformers`; run from the repository root:
`python examples/rl/arith/make_arith.py`."""

import itertools
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

HERE = Path(__file__).parent
# one special token, <eos> (also the pad): decoding drops special tokens, so a model that
# emitted a BOS or PAD mid-answer would hide it from the reward; <unk> is no special token
SPECIALS = ["<unk>", "<eos>"]
CHARACTERS = list("0123456789+=Q")

vocab = {token: i for i, token in enumerate(SPECIALS + CHARACTERS)}
core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
core.decoder = decoders.Fuse()  # characters joined without spaces
# padding with the eos token, as Llama does
tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<eos>", eos_token="<eos>",
    # the prompt is the user's message, "Q:" before it; the model answers right after it
    chat_template="{% for m in messages %}Q{{ m['content'] }}{% endfor %}")
tokenizer.save_pretrained(HERE / "tiny-arith")

config = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=16, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=None, eos_token_id=vocab["<eos>"], pad_token_id=vocab["<eos>"])
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).eval().save_pretrained(HERE / "tiny-arith")

rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in itertools.product(range(5), repeat=2)]
rows += [{"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c)} for a, b, c in itertools.product(range(4), repeat=3)]
with open(HERE / "train.jsonl", "w") as handle:
    for row in rows:
        handle.write(json.dumps(row) + "\n")
print(f"wrote {HERE / 'tiny-arith'} and {len(rows)} prompts to {HERE / 'train.jsonl'}")
