"""Release: the model card and the Hugging Face Hub upload."""
