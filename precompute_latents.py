"""Encode images and captions once into the latent shards training reads (see data/precompute.py).

    python precompute_latents.py --model SD3_DIR (--images DIR | --manifest FILE) --out DIR [...]
"""

import sys

from data.precompute import main

if __name__ == "__main__":
    sys.exit(main())
