"""Text → what each request says: input text checked and split (`text`), where a reply's first phrase ends
(`first_phrase`), each sentence's prompt and budget (`prompt`), cloned voices (`voices`), the reply room both
adapters speak through (`reply`), word timestamps (`words`) and speed (`stretch`).

May import: the package root's modules, backends.protocol (a request's shape), codec (a voice's reference frames).
"""
