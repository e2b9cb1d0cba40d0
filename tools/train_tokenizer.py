"""Train the demo targets' tokenizer: byte-level BPE on the train split of the corpus (tools/corpus.py).

Vocabulary 4096 = 2 special tokens + 256 byte symbols + 3838 merges. Special tokens:
  id 0 `<|endoftext|>`  end of sequence and document separator (also used for padding)
  id 1 `<|mask|>`       the DFlash drafter's mask_token_id (never in the corpus)
Byte-level pre-tokenizer and decoder without a prefix space, so decode(encode(source)) == source for any
text, whitespace and newlines included. Saved with PreTrainedTokenizerFast.save_pretrained, so
transformers' AutoTokenizer.from_pretrained(dir) loads it.

    python -m tools.train_tokenizer --out DIR [--corpus DIR] [--vocab 4096]
"""

import argparse
import sys
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tools.corpus import list_files, read_texts

EOS, MASK = "<|endoftext|>", "<|mask|>"


def train_tokenizer(corpus_dir=None, vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the train split; ids 0 and 1 are EOS and MASK."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(list_files("train", corpus_dir)), trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(MASK) == 1
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--corpus", help="directory of *.py/*.txt files (default: the stdlib)")
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    train_tokenizer(args.corpus, args.vocab).save_pretrained(args.out)


if __name__ == "__main__":
    main()
