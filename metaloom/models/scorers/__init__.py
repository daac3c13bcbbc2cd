"""Models that score rather than generate: process reward models (`prm`), sequence classifiers
(`classifier`) and sentence embeddings (`embedding`)."""
