"""The pdserve command line."""
