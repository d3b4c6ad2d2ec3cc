"""The bundled knowledge base (kdn/cli/knowledge.py): five documents in order, and questions."""
from kdn.cli.knowledge import bundled_documents, bundled_questions


def test_bundled_documents_come_in_file_order_with_their_text():
    docs = bundled_documents()
    assert [n for n, _ in docs] == ["declaration-of-independence", "constitution-article-ii",
                                    "constitution-article-iii", "bill-of-rights", "gettysburg-address"]
    assert docs[0][1].lstrip().startswith("#") or "When in the Course" in docs[0][1]
    assert all(len(text) > 500 for _, text in docs)


def test_bundled_questions_are_the_non_empty_lines():
    qs = bundled_questions()
    assert len(qs) >= 3 and all(q == q.strip() and q for q in qs)
