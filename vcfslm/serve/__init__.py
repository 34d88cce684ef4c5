"""Serving under arriving requests: the continuous-batching scheduler that drives the
engine's slots, and the HTTP side (an OpenAI-compatible streaming client, the server
processes, the window driver against them). The only room that speaks HTTP.
"""
