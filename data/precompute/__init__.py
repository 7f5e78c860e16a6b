"""Encoding image-caption collections once into a latent dataset (data/latents.py); the command and what it does
are in precompute_latents.py. The parts, in the order a run uses them:

- inputs.py: image folders, JSONL manifests and webdataset shards, as units of work, checked first;
- images.py: aspect buckets, orientation, resize and centre-crop;
- encoders.py: the pipeline's VAE and text encoders (the family's);
- units.py: one unit encoded into output shards and its report, the marker that it is finished;
- ranks.py: the processes of a launch, and the progress bar;
- job.py: the output directory, the units left, and the dataset written last.
"""
