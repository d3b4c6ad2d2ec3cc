"""Prompts: where a real chat prompt puts knowledge, so the KB's tokens are an exact prefix.

A KB's knowledge is the system turn of the model's chat template; a question (or a chat
request's turns) is rendered after a probe system turn whose rendering is cut off, so the
knowledge tokens followed by the turns' tokens are exactly the tokens of the whole rendered
prompt (tests compare with apply_chat_template). `Prompts` is the part of the model
(kdn.engines.transformers.model.Model) that renders and tokenizes; it needs the model's
`tokenizer`, `name` and `vocab_size`. `Text` is the same over a model folder with no weights
loaded.
"""
from kdn.core.errors import ModelError

_PROBE = "kdn-probe-knowledge"


class Prompts:
    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list:
        """Token ids of text as it stands (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _text(value, what: str) -> str:
        if not isinstance(value, str):
            raise ModelError(f"{what} must be a str, got {type(value).__name__}")
        return value

    def knowledge_text(self, text: str) -> str:
        """The rendered system turn carrying the knowledge (what a real chat prompt starts with)."""
        return self._render([{"role": "system", "content": self._text(text, "knowledge")}], False)

    def turns_text(self, messages, generation_prompt: bool = True) -> str:
        """The rendered prompt after a system turn: these chat turns and (generation_prompt)
        the assistant's generation prompt. They are rendered after a probe system turn whose
        rendering is cut off, so a KB's knowledge turn followed by these is exactly the whole
        rendered prompt. Without the generation prompt, a conversation that ends in the
        assistant's answer renders as the next turn's prompt will start (conversation KV)."""
        system = [{"role": "system", "content": _PROBE}]
        head = self._render(system, False)
        full = self._render(system + list(messages), generation_prompt)
        if not full.startswith(head):
            raise ModelError(f"{self.name}'s chat template does not render the system turn as a prefix "
                             "of the prompt; knowledge cannot be cached as a prefix")
        return full[len(head):]

    def chat_tokens(self, messages, generation_prompt: bool = True) -> list:
        """Token ids of a whole chat with no knowledge base: the messages as the chat template
        renders them (its default system turn included, if it has one), then (generation_prompt)
        the assistant's generation prompt."""
        return self.encode(self._render(list(messages), generation_prompt))

    def question_text(self, question: str) -> str:
        """The rest of the rendered prompt: user turn and the assistant's generation prompt."""
        return self.turns_text([{"role": "user", "content": self._text(question, "question")}])

    def knowledge_tokens(self, text: str) -> list:
        """Tokens of the system turn holding `text`: an exact prefix of prompt_tokens(text, q).

        The turn ends in a special token (<|im_end|>) and the next turn starts with one, and the
        tokenizer splits on special tokens before BPE, so tokenizing the turns apart gives the
        same ids as tokenizing the whole prompt (tests compare with apply_chat_template).
        Control tokens written inside the text are parsed as control tokens, as the chat
        template itself does.
        """
        return self.encode(self.knowledge_text(text))

    def question_tokens(self, question: str) -> list:
        return self.encode(self.question_text(question))

    def prompt_tokens(self, knowledge: str, question: str) -> list:
        return self.knowledge_tokens(knowledge) + self.question_tokens(question)

    def check_tokens(self, tokens, what="tokens") -> list:
        """tokens as a list of ints, ModelError unless non-empty and inside the vocabulary."""
        try:
            ids = [int(t) for t in tokens]
        except (TypeError, ValueError) as e:
            raise ModelError(f"{what} must be a sequence of ints: {e}") from None
        if not ids:
            raise ModelError(f"{what} is empty: nothing to compute")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ModelError(f"token id {bad} in {what} is outside the vocabulary [0, {self.vocab_size})")
        return ids


class Text(Prompts):
    """Prompts over a converted model folder's tokenizer, chat template and config alone, no
    weights: what tokenizing a KB and checking its length take (`kdn publish` finds an
    unchanged KB with no model loaded). ModelError where the folder cannot be read."""

    def __init__(self, folder, name: str):
        from transformers import AutoConfig, AutoTokenizer

        from kdn.engines.transformers.convert import quiet_transformers
        with quiet_transformers():
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
                self.config = AutoConfig.from_pretrained(folder, local_files_only=True)
            except (OSError, ValueError) as e:
                raise ModelError(f"cannot read the tokenizer of {str(folder)!r} ({type(e).__name__}: {e}); "
                                 "delete that folder to convert again") from e
        self.name, self.vocab_size = name, self.config.vocab_size
