"""Using a converted model as llama.cpp users do: the OpenAI- and llama-server-compatible server
(`server`), the answer read as it streams (`answers`: tool calls, reasoning) and the terminal chat
(`chat`)."""
