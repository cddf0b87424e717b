"""Token ids → 24 kHz PCM: ids into phase-checked 7-code frames (`codes`), SNAC loaded (`snac`) and run as
streaming layers (`layers`, `gemm`), batched across streams (`decoder`).

May import: root.
"""
