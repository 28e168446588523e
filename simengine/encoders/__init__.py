"""Answer encoders: one module per OpenAI API shapes its answers (streamed chunks and whole bodies) as vLLM 0.32
does, behind `interface.ApiEncoder`; `registry.create_encoders` builds one of each."""
