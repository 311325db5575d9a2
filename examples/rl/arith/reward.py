"""The example's reward: 1 for the right answer, partial credit on the way there.

nereus train calls reward(prompts, responses, answer=[...]) on rank 0 each step with the
decoded responses (cut at the end-of-sequence token) and the dataset's `answer` field.
"""


def reward(prompts, responses, answer, **row):
    out = []
    for response, expected in zip(responses, answer):
        text = response.strip()
        if text == expected:
            out.append(1.0)
        elif text.isdigit():  # a number: credit for its digits in the right places
            right = sum(a == b for a, b in zip(text, expected))
            out.append(0.2 + 0.3 * right / max(len(text), len(expected)))
        else:
            out.append(0.0)
    return out
