"""The serving tests' tiny engine (test_serving.py, test_speculative.py, test_structured_outputs.py)."""

# top-k 8 of up to 40 keys: the selection matters; pages of 8 tokens, chunks of 8
BASE = dict(max_target_length=40, max_prefill_length=24, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=8, serve_max_num_seqs=4, serve_max_num_tokens=24, prefill_chunk_size=8,
            serve_width_buckets=1, serve_context_buckets=1)  # few step shapes: few compiles (the server tests run the defaults)
SYSTEM = [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a shared prompt prefix (one full page and a half)
PROMPTS = [SYSTEM + [30, 31], [1, 99, 7], SYSTEM + [40], [5] * 17, SYSTEM + [30, 32, 33], [1, 2]]
NEW = 6
