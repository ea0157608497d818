"""fedattr: which clients of a federated LLM fine-tuning run trained on watermarked documents,
seen only through secure-aggregation subset sums."""

__version__ = "0.1.0"
