"""Model loading: packaged models, any Hugging Face directory, and the adapter the engine drives."""
