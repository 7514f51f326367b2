"""Text in and out: the tokenizer (`tokenizer`), incremental detokenization (`detokenizer`), the chat
messages and templates (`chat_messages`, `chat_template`, `chat_deepseek_v4`) and the checks of text
fields (`text_checks`). Imports only deepinfer.engine.config and outside libraries.
"""
