"""Text → what each request says: input text checked and split (`text`), where a reply's first phrase ends
(`first_phrase`), each sentence's prompt and budget (`prompt`), cloned voices (`voices`), the reply room both
adapters speak through (`reply`), word timestamps (`words`) and speed (`stretch`).

May import: root, backends, codec. (backends.protocol: a request's shape; codec.codes: a voice's reference frames.)
"""
