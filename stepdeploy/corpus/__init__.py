"""Training data for real: local text tokenized into megatron-core's indexed dataset format (`stepdeploy data
prepare`), and such a dataset described for a rendered run (`render --data`, `rollout run --data`).

- description.py: PREFIX.json (what the ids mean, the largest id, checksums) as a strict model; `Corpus`;
- inputs.py: the documents of text and JSONL files, refused whole when they are not regular UTF-8 text;
- tokenizer.py: byte-level, a Hugging Face tokenizer.json, or a byte-level BPE trained on the corpus;
- output.py: private temporaries linked into place, all or nothing;
- prepare.py: the three together; stored.py: a dataset read back and checked (`load_prepared`, `ShippedDataset`).

Byte-level (each byte its id, 256 ends a document, 257 ids) stays the default: nothing to download or train,
and datasets prepared before real tokenizers still load.
"""

from stepdeploy.corpus.description import BYTE, Corpus, Description, TokenizerInfo, padded_vocab
from stepdeploy.corpus.prepare import prepare
from stepdeploy.corpus.stored import MAX_SHIPPED_BYTES, ShippedDataset, load_prepared

TOKENIZER = BYTE.name
EOD = BYTE.eod
VOCAB = BYTE.vocab

__all__ = ["EOD", "MAX_SHIPPED_BYTES", "TOKENIZER", "VOCAB", "Corpus", "Description", "ShippedDataset",
           "TokenizerInfo", "load_prepared", "padded_vocab", "prepare"]
