"""datagen: prompts in, a tokenized training dataset (token ids + loss masks) in S3 out."""

__version__ = "0.1.0"
