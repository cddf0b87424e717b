"""The workshop: benchmarks, FP8 quantisation, random-weight test checkpoints, replay, WAV files.

Nothing in the runtime (engine, decoder, backends, adapters) imports from here.

May import: any.
"""
