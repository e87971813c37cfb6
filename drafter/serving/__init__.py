"""Serving: starting and talking to a vLLM server, and the servable model directory of a drafter."""
