"""Real-text prompts of varied lengths (short to ~1k tokens) for engine tests and benchmarks."""

from __future__ import annotations

PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps out of habit. "
    "At the top he trimmed the wick, polished the great lens and watched the ships pass in the dusk.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. Plants store the sugar "
    "as starch, and almost every food chain on land begins with this quiet chemistry in green leaves.",
    "A good recipe for bread needs flour, water, salt and yeast. Knead the dough until it is smooth, "
    "let it rise in a warm place, shape it, let it rise again, and bake it until the crust sounds hollow.",
    "In 1869 the first transcontinental railroad in the United States was completed, joining east and "
    "west. Travel that once took months by wagon could now be done in about a week.",
    "To sort a list with merge sort, split it in half, sort each half recursively, and merge the two "
    "sorted halves by repeatedly taking the smaller front element. The running time is n log n.",
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a small "
    "pond, benches in the shade and a playground that children of every age could enjoy safely.",
]

QUESTIONS = [
    "What is the main idea of the text above?",
    "Summarize the passage in one sentence.",
    "List two facts from the text.",
    "What happens next?",
]


def prompt_of_length(target_words: int, seed: int) -> str:
    """Concatenate paragraphs (rotated by seed) until about `target_words` words, then ask a question."""
    words: list[str] = []
    i = seed
    while len(words) < target_words:
        words.extend(PARAGRAPHS[i % len(PARAGRAPHS)].split())
        i += 1
    return " ".join(words[:target_words]) + "\n\n" + QUESTIONS[seed % len(QUESTIONS)]


def varied_prompts(n: int = 16, longest_words: int = 700) -> list[str]:
    """n prompts from a few words to ~longest_words words (~1k tokens at the top)."""
    sizes = [max(2, int(longest_words * (k / (n - 1)) ** 2)) for k in range(n)]
    return [prompt_of_length(size, k) for k, size in enumerate(sizes)]
