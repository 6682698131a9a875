"""verl's rule scorers, exactly: tables of model outputs scored as verl scores them.

Every expected value below was produced by running verl's own scorer functions
(verl/utils/reward_score/{gsm8k,math_reward,math_dapo,search_r1_like_qa_em}.py of the verl
snapshot at commit b178a3cd56f5, imported by path in a scratch directory) on exactly these
strings, and written here as literals; verl itself is not imported. The tables mix correct and
wrong answers with the formats that separate verl from a lenient scorer: '####' spacing, a
trailing period, '$' and commas, answers outside the last 300 characters, boxes (nested, \\fbox,
units, \\dfrac), "Answer:" lines. Also: the data_source routing, the reward registry and
decorator, hybrid weights, config selection, their one-line errors, and the data tools' rows.
"""

import json
import math
import re
from pathlib import Path

import pytest

from hybridengine.config.loading import load_config
from hybridengine.rl import rewards
from hybridengine.rl.rewards import (
    Reward, RewardError, build_reward, default_compute_score, gsm8k_score,
    math_dapo_score, math_score, register_reward_fn, registered_rewards, score_batch,
    search_r1_score)

FIXTURES = Path(__file__).parent / "fixtures"
MATH500 = Path("/work/shared/data/math500/test.jsonl")
TOOLS = Path(__file__).resolve().parents[1] / "tools" / "data"

# Long reasoning used to push answers in or out of the last 300 characters.
WORK = ("Let me set up the problem carefully. Each box holds 12 pencils and there are 6 boxes, "
        "so that is 12 * 6 = 72 pencils in total before anyone takes any. Then 3 students each "
        "take 4 pencils, which is 3 * 4 = 12 pencils, and the teacher adds 12 more from the "
        "cupboard, so the count goes back up to the same total again as before. ")
MATH_WORK = (r"We first complete the square: $x^2 - 6x + 13 = (x - 3)^2 + 4$. Since $(x-3)^2 \ge 0$ "
             r"for all real $x$, the expression is minimised when $x = 3$, giving a minimum of $4$. "
             r"We should double-check that nothing in the constraints excludes $x = 3$; the domain "
             r"is all reals, so the minimum is attained and equals the constant term. ")

# (output, ground truth, verl strict score, verl flexible score)
GSM8K_TABLE = [
    ("Natalia sold 48/2 = 24 clips in May.\n"
     "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72",
     "72", 1.0, 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n"
     "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 73",
     "72", 0.0, 0.0),
    ("Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n####  72",
     "72", 0.0, 1.0),
    ("She sold 24 clips in May, so 48 + 24 = 72 clips in total.\n#### 72.",
     "72", 0.0, 0.0),
    ("She sold 24 clips in May, so 48 + 24 = 72 clips in total.\n#### 72.0",
     "72", 0.0, 0.0),
    ("She sold 24 clips in May, so 48 + 24 = 72 clips in total.\n#### 72.00",
     "72", 0.0, 0.0),
    ("Total: 48 + 24 = 72 clips.\n####72",
     "72", 0.0, 1.0),
    ("Total: 48 + 24 = 72 clips.\n#### $72",
     "72", 0.0, 1.0),
    ("Total: 48 + 24 = 72 clips.\n#### 72 clips",
     "72", 1.0, 1.0),
    ("Total: 48 + 24 = 72 clips.\n#### 72\n",
     "72", 1.0, 1.0),
    ("She sold 48 + 24 = 72 clips in total. The answer is 72.",
     "72", 0.0, 0.0),
    ("She sold 48 + 24 = 72 clips in total. The answer is 72",
     "72", 0.0, 1.0),
    ("She sold 48 + 24 = 72 clips in total.",
     "72", 0.0, 1.0),
    ("The answer is 72 clips.",
     "72", 0.0, 1.0),
    ("So the final answer is **72**.",
     "72", 0.0, 1.0),
    ("Final answer: $\\boxed{72}$",
     "72", 0.0, 1.0),
    ("First try: 48 + 20 = 68\n#### 68\nWait, May was 24, so 48 + 24 = 72.\n#### 72",
     "72", 1.0, 1.0),
    ("48 + 24 = 72\n#### 72\nDouble-checking: 72 - 24 = 48, correct.",
     "72", 1.0, 0.0),
    ("#### 72\n" + WORK,
     "72", 0.0, 0.0),
    (WORK + "#### 72",
     "72", 1.0, 1.0),
    (WORK + "So the answer is 72",
     "72", 0.0, 1.0),
    ("#### 72\n" + WORK + "Total: 72",
     "72", 0.0, 1.0),
    ("Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $10.\n#### 10",
     "10", 1.0, 1.0),
    ("Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10.",
     "10", 0.0, 0.0),
    ("Weng earns $0.2 per minute, so she earned $10.\n#### $10",
     "10", 0.0, 1.0),
    ("Weng earns $0.2 per minute, so she earned $10.\n#### 10 dollars",
     "10", 1.0, 1.0),
    ("The house costs 80,000 + 50,000 = $130,000 in total.\n#### 130,000",
     "130000", 1.0, 0.0),
    ("The house costs 80,000 + 50,000 = $130,000 in total.\n#### 130000",
     "130000", 1.0, 1.0),
    ("The house costs 80,000 + 50,000 = $130,000 in total.",
     "130000", 0.0, 0.0),
    ("The house costs 80,000 + 50,000 = 130000 dollars in total.",
     "130000", 0.0, 1.0),
    ("The profit is 200,000 - 130,000 = 70,000.\n#### 70,000",
     "70000", 1.0, 0.0),
    ("The profit is 200,000 - 130,000 = 70,000 dollars",
     "70000", 0.0, 0.0),
    ("James writes 3 pages to 2 friends twice a week, 3*2*2 = 12 pages a week.\n"
     "In a year that is 12*52 = 624 pages.\n#### 624",
     "624", 1.0, 1.0),
    ("He writes 624 pages a year.\n#### 6 2 4",
     "624", 0.0, 0.0),
    ("The temperature drops 3 degrees every hour for 4 hours: 5 - 12 = -7.\n#### -7",
     "-7", 1.0, 1.0),
    ("The temperature drops 3 degrees every hour for 4 hours: 5 - 12 = -7.\n#### 7",
     "-7", 0.0, 0.0),
    ("The temperature drops 12 degrees in total, ending at -7",
     "-7", 0.0, 1.0),
    ("The temperature ends at - 7 degrees.\n#### - 7",
     "-7", 0.0, 0.0),
    ("Each slice is 1/8 of the pizza, which is 0.125.\n#### 0.125",
     "0.125", 1.0, 1.0),
    ("Half of the cake is left.\n#### .5",
     "0.5", 0.0, 0.0),
    ("Half of the cake is left.\n#### 0.5",
     "0.5", 1.0, 1.0),
    ("The cost per apple is 1.50 + 1.00 = 2.50.\n#### 2.5",
     "2.5", 1.0, 1.0),
    ("The cost per apple is 1.50 + 1.00 = 2.50.\n#### 2.50",
     "2.5", 0.0, 0.0),
    ("Tina makes $18.00 an hour and works 10 hours, so she makes 180.00 dollars.\n#### 180",
     "180", 1.0, 1.0),
    ("Tina makes $18.00 an hour and works 10 hours, so she makes 180.00",
     "180", 0.0, 0.0),
    ("Betty has 100/2 = 50 dollars. She needs 100 - 50 - 15 - 30 = 5 more.\n#### 5",
     "5", 1.0, 1.0),
    ("Betty needs 5 more dollars.\n\n#### 5\n\nThe answer is 5 dollars.",
     "5", 1.0, 1.0),
    ("Betty needs five more dollars.",
     "5", 0.0, 0.0),
    ("I am not sure how to solve this problem.",
     "5", 0.0, 0.0),
    ("",
     "5", 0.0, 0.0),
    ("...",
     "5", 0.0, 0.0),
    ("Hmm, let's see, well, okay",
     "5", 0.0, 0.0),
    ("There are 3/4 of the students left.",
     "3", 0.0, 0.0),
    ("Ratio is 3:4 so the answer is 3:4",
     "4", 0.0, 1.0),
    ("The answer is 1.5e3 meters.\n#### 1.5e3",
     "1500", 0.0, 0.0),
    ("So she has 1,000,000 dollars.\n#### 1,000,000",
     "1000000", 1.0, 0.0),
    ("So she has 1,000,000 dollars.",
     "1000000", 0.0, 0.0),
    ("The total is 35.\n#### 35\n#### 35",
     "35", 1.0, 1.0),
    ("The total is 35.\n#### 35,",
     "35", 1.0, 0.0),
    ("The total is 35.\n####\n35",
     "35", 0.0, 1.0),
    ("The total is 35.\n#### The answer is 35",
     "35", 0.0, 1.0),
    ("Step 1: 20 + 15 = 35.\nStep 2: there are 35 students.\n#### 35.0.",
     "35", 0.0, 0.0),
    ("So the answer is 1,080.\n#### 1,080",
     "1,080", 0.0, 1.0),
    ("So the answer is 1080.\n#### 1080",
     "1080", 1.0, 1.0),
    ("The answer is \u221212.\n#### \u221212",
     "-12", 0.0, 0.0),
    ("The answer is -12.\n#### -12",
     "-12", 1.0, 1.0),
    ("The answer is -12.\n#### -12.",
     "-12", 0.0, 0.0),
    ("The answer is 48 clips.\n\n**#### 48**",
     "48", 1.0, 1.0),
]

# (output, ground truth, verl math_reward score)
MATH_TABLE = [
    (r"Thus the answer is $\boxed{\frac{1}{2}}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{\dfrac{1}{2}}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{\tfrac{1}{2}}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{\frac12}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{1/2}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{0.5}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{.5}$.",
     r"\frac{1}{2}", 1.0),
    (r"Thus the answer is $\boxed{0.50}$.",
     r"\frac{1}{2}", 0.0),
    (r"Thus the answer is $\boxed{\frac{2}{4}}$.",
     r"\frac{1}{2}", 0.0),
    (r"Thus the answer is $\boxed{\frac{1}{3}}$.",
     r"\frac{1}{2}", 0.0),
    (r"So $r = 3$ and $\theta = \frac{\pi}{2}$: $\boxed{\left( 3, \frac{\pi}{2} \right)}$",
     r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"So the polar coordinates are $\boxed{(3,\frac{\pi}{2})}$.",
     r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"So the polar coordinates are $\boxed{(3, \pi/2)}$.",
     r"\left( 3, \frac{\pi}{2} \right)", 0.0),
    (r"The minimum value is $\boxed{4}$.",
     "4", 1.0),
    (r"The minimum value is $\boxed{4.}$",
     "4", 0.0),
    (r"The minimum value is $\boxed{4.0}$",
     "4", 0.0),
    (r"The minimum value is $\boxed{x=4}$",
     "4", 1.0),
    (r"The minimum value is $\boxed{y_{\min} = 4}$",
     "4", 0.0),
    (r"The minimum value is \boxed 4$.",
     "4", 1.0),
    (r"The minimum value is \fbox{4}.",
     "4", 0.0),
    (r"The minimum value is 4.",
     "4", 0.0),
    (r"The minimum value is $\boxed{4",
     "4", 0.0),
    (r"First guess $\boxed{3}$, but checking again gives $\boxed{4}$.",
     "4", 1.0),
    (r"Answer $\boxed{4}$; an earlier draft said \boxed 3 instead.",
     "4", 0.0),
    (r"\boxed{\boxed{4}}",
     "4", 1.0),
    (r"The winner is $\boxed{\text{Evelyn}}$.",
     r"\text{Evelyn}", 1.0),
    (r"The winner is $\boxed{Evelyn}$.",
     r"\text{Evelyn}", 0.0),
    (r"The angle is $\boxed{90^\circ}$.",
     r"90^\circ", 1.0),
    (r"The angle is $\boxed{90^{\circ}}$.",
     r"90^\circ", 1.0),
    (r"The angle is $\boxed{90}$ degrees.",
     r"90^\circ", 1.0),
    (r"The area is $\boxed{864 \text{ inches}^2}$.",
     r"864 \mbox{ inches}^2", 0.0),
    (r"The area is $\boxed{864}$ square inches.",
     r"864 \mbox{ inches}^2", 0.0),
    (r"The area is $\boxed{864 \mbox{ inches}^2}$.",
     r"864 \mbox{ inches}^2", 1.0),
    (r"The length is $\boxed{12 \text{ cm}}$.",
     "12", 1.0),
    (r"The length is $\boxed{12\text{cm}}$.",
     "12", 0.0),
    (r"The length is $\boxed{12\,\text{cm}}$.",
     "12", 0.0),
    (r"The length is $\boxed{12 \text{ cm} \text{ long}}$.",
     "12", 0.0),
    (r"There are $\boxed{10,080}$ arrangements.",
     r"10,\!080", 1.0),
    (r"There are $\boxed{10080}$ arrangements.",
     r"10,\!080", 0.0),
    (r"There are $\boxed{10{,}080}$ arrangements.",
     r"10,\!080", 0.0),
    (r"The total cost is $\boxed{\$18.90}$.",
     r"\$18.90", 1.0),
    (r"The total cost is $\boxed{18.90}$ dollars.",
     r"\$18.90", 1.0),
    (r"The total cost is $\boxed{18.9}$ dollars.",
     r"\$18.90", 0.0),
    (r"The percentage is $\boxed{50\%}$.",
     "50", 1.0),
    (r"The percentage is $\boxed{50}$.",
     r"50\%", 1.0),
    (r"So $\boxed{11\sqrt{2}}$.",
     r"11\sqrt2", 1.0),
    (r"So $\boxed{11\sqrt2}$.",
     r"11\sqrt{2}", 1.0),
    (r"So $\boxed{\frac{\sqrt{3}}{2}}$.",
     r"\frac{\sqrt{3}}{2}", 1.0),
    (r"So $\boxed{\dfrac{\sqrt{3}}{2}}$.",
     r"\frac{\sqrt3}{2}", 1.0),
    (r"So $\boxed{\sqrt{3}/2}$.",
     r"\frac{\sqrt{3}}{2}", 0.0),
    (r"The line is $\boxed{y = 2x + 3}$.",
     "y=2x+3", 1.0),
    (r"The line is $\boxed{y = 2x + 3}$.",
     "2x+3", 1.0),
    (r"The function is $\boxed{f(x) = 2x + 3}$.",
     "2x+3", 0.0),
    (r"The slope is $\boxed{-\frac{1}{2}}$.",
     r"-\frac{1}{2}", 1.0),
    (r"The slope is $\boxed{\frac{-1}{2}}$.",
     r"-\frac{1}{2}", 0.0),
    (r"The slope is $\boxed{-1/2}$.",
     r"-\frac{1}{2}", 0.0),
    (r"The solutions are $\boxed{2, 5}$.",
     "2,5", 1.0),
    (r"The solutions are $\boxed{5, 2}$.",
     "2,5", 0.0),
    (r"The interval is $\boxed{[2, 5)}$.",
     "[2,5)", 1.0),
    (r"The answer is $\boxed{\text{(C)}}$.",
     r"\text{(C)}", 1.0),
    (r"The answer is $\boxed{(C)}$.",
     r"\text{(C)}", 0.0),
    (r"The answer is $\boxed{C}$.",
     r"\text{(C)}", 0.0),
    (r"The sum is $\boxed{2\pi}$.",
     r"2 \pi", 1.0),
    (r"The sum is $\boxed{\infty}$.",
     r"\infty", 1.0),
    (r"The matrix is $\boxed{\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}}$.",
     r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", 1.0),
    ("**Final Answer**\n\\[\n\\boxed{12}\n\\]",
     "12", 1.0),
    (MATH_WORK + r"The minimum is $\boxed{4}$.",
     "4", 1.0),
    (r"The minimum is $\boxed{4}$. " + MATH_WORK,
     "4", 1.0),
    (r"The answer is $\boxed{\frac}$.",
     r"\frac", 1.0),
    (r"The answer is $\boxed{3\sqrt}$.",
     r"3\sqrt", 1.0),
    (r"The answer is $\boxed{}$.",
     "", 1.0),
    (r"The answer is $\boxed{1,000}$.",
     "1000", 0.0),
    (r"The answer is $\boxed{k = 7}$.",
     "7", 1.0),
]

# (output, ground truth, verl math_dapo score, acc, pred)
DAPO_TABLE = [
    ("The probability is 3/4.\nAnswer: 3/4",
     r"\frac{3}{4}", -1.0, False, '3/4'),
    ("The probability is 3/4.\nAnswer: 3/4",
     "3/4", 1.0, True, '3/4'),
    ("The probability is three quarters.\nAnswer: \\frac{3}{4}",
     r"\frac{3}{4}", 1.0, True, '\\frac{3}{4}'),
    ("Answer: \\frac34",
     r"\frac{3}{4}", 1.0, True, '\\frac{3}{4}'),
    ("Answer: \\dfrac{3}{4}",
     r"\frac{3}{4}", -1.0, False, '\\dfrac{3}{4}'),
    ("Answer: $\\frac{3}{4}$",
     r"\frac{3}{4}", 1.0, True, '\\frac{3}{4}'),
    ("Answer: $\\frac{3}{4}$.",
     r"\frac{3}{4}", 1.0, True, '\\frac{3}{4}'),
    ("Answer: 0.75",
     r"\frac{3}{4}", -1.0, False, '0.75'),
    ("So there are 34 ways in total.\nAnswer: 34",
     "34", 1.0, True, '34'),
    ("So there are 34 ways in total.\nAnswer: 34.",
     "34", -1.0, False, '34.'),
    ("So there are 34 ways in total.\nAnswer: 35",
     "34", -1.0, False, '35'),
    ("So there are 34 ways in total.\nanswer: 34",
     "34", 1.0, True, '34'),
    ("So there are 34 ways in total.\nANSWER : 34",
     "34", 1.0, True, '34'),
    ("So there are 34 ways in total.\nAnswer:34",
     "34", 1.0, True, '34'),
    ("So there are 34 ways in total.\n**Answer:** 34",
     "34", -1.0, False, '**34'),
    ("So there are 34 ways in total.\nFinal Answer: 34",
     "34", 1.0, True, '34'),
    ("So there are 34 ways in total.\nThe final answer is 34.",
     "34", -1.0, False, '[INVALID]'),
    ("So there are 34 ways in total.",
     "34", -1.0, False, '[INVALID]'),
    ("",
     "34", -1.0, False, '[INVALID]'),
    ("Answer: 34 ways",
     "34", 1.0, True, '34'),
    ("Answer: 34 degrees",
     "34", 1.0, True, '34'),
    ("Answer: 34^\\circ",
     "34", 1.0, True, '34'),
    ("Answer: 34 \\text{cm}",
     "34", 1.0, True, '34'),
    ("Answer: 34 cm",
     "34", 1.0, True, '34'),
    ("Answer: \\boxed{34}",
     "34", 1.0, True, '34'),
    ("Answer: $\\boxed{34}$",
     "34", 1.0, True, '34'),
    ("The answer is \\boxed{34}.",
     "34", -1.0, False, '[INVALID]'),
    ("Answer: x = 34",
     "34", 1.0, True, '34'),
    ("Answer: x = 34",
     "x=34", 1.0, True, '34'),
    ("Answer: 1,000",
     "1000", 1.0, True, '1000'),
    ("Answer: 1{,}000",
     "1000", 1.0, True, '1000'),
    ("Answer: 1000",
     "1,000", 1.0, True, '1000'),
    ("Answer: 10 dollars",
     "10", 1.0, True, '10'),
    ("Answer: \\$10",
     "10", 1.0, True, '10'),
    ("Answer: $10$",
     "10", 1.0, True, '10'),
    ("Answer: -5",
     "-5", 1.0, True, '-5'),
    ("Answer: - 5",
     "-5", 1.0, True, '-5'),
    ("Answer: 5",
     "-5", -1.0, False, '5'),
    ("Answer: 2\\sqrt{3}",
     r"2\sqrt3", 1.0, True, '2\\sqrt{3}'),
    ("Answer: 2\\sqrt3",
     r"2\sqrt{3}", 1.0, True, '2\\sqrt{3}'),
    ("Answer: 2 \\sqrt{3}",
     r"2\sqrt{3}", 1.0, True, '2\\sqrt{3}'),
    ("Answer: \\sqrt{12}",
     r"2\sqrt{3}", -1.0, False, '\\sqrt{12}'),
    ("Answer: (B)",
     "(B)", 1.0, True, '(B)'),
    ("Answer: B",
     "(B)", -1.0, False, 'B'),
    ("Answer: \\text{(B)}",
     "(B)", 1.0, True, '(B)'),
    ("Answer: \\textbf{(B)}",
     "(B)", 1.0, True, '(B)'),
    ("Answer: 3, 4",
     "3,4", 1.0, True, '34'),
    ("Answer: 3 and 4",
     "3,4", -1.0, False, '3and4'),
    ("Answer: 3 \\text{ and } 4",
     "3,4", 1.0, True, '34'),
    ("Answer: \\pi",
     r"\pi", 1.0, True, '\\pi'),
    ("Answer: 2\\pi",
     r"2 \pi", 1.0, True, '2\\pi'),
    ("Answer: 0.5",
     r"\frac{1}{2}", -1.0, False, '0.5'),
    ("Answer: 1/2",
     "1/2", 1.0, True, '1/2'),
    ("Answer: 4\nWait, I made an error. Recomputing gives 5.\nAnswer: 5",
     "5", 1.0, True, '5'),
    ("Answer: 5\nAnswer: 4",
     "5", -1.0, False, '4'),
    ("Answer: 5" + "\n" + MATH_WORK,
     "5", -1.0, False, '[INVALID]'),
    (MATH_WORK + "Answer: 4",
     "4", 1.0, True, '4'),
    (WORK + WORK + "Answer: 72",
     "72", 1.0, True, '72'),
    ("Answer: 4\n\nThat is the minimum value of the quadratic.",
     "4", 1.0, True, '4'),
    ("Answer: an integer 7",
     "7", -1.0, False, 'integer7'),
    ("Answer: 7 integers",
     "7", 1.0, True, '7'),
    ("Answer: \\overline{7}",
     "7", 1.0, True, '7'),
    ("Answer: \\mbox{7}",
     "7", 1.0, True, '7'),
    ("Answer: 7\\%",
     "7", -1.0, False, '7\\%'),
    ("Answer: 12 students",
     "12", 1.0, True, '12'),
    ("Answer: 5 hours",
     "5", 1.0, True, '5'),
    ("Answer: \\left(1, 2\\right)",
     "(1,2)", -1.0, False, '\\left(1,2\\right)'),
    ("Answer: (1, 2)",
     "(1,2)", 1.0, True, '(1,2)'),
    ("Answer: [INVALID]",
     "5", -1.0, False, '[INVALID]'),
]

# (output, ground truth, verl search-R1 exact-match score)
SEARCH_R1_TABLE = [
    ("<think>The capital of France is Paris.</think><answer>Paris</answer>", {"target": ["Paris"]}, 1.0),
    ("<answer>paris.</answer>", {"target": ["Paris"]}, 1.0),
    ("<answer>The Paris</answer>", {"target": ["Paris"]}, 1.0),
    ("<answer>Paris, France</answer>", {"target": ["Paris"]}, 0.0),
    ("<answer>Lyon</answer> no wait <answer>Paris</answer>", {"target": ["Paris"]}, 1.0),
    ("<answer>Paris</answer> then <answer>Lyon</answer>", {"target": ["Paris"]}, 0.0),
    ("The answer is Paris.", {"target": ["Paris"]}, 0.0),
    ("<answer>\n  Barack Obama \n</answer>", {"target": ["Barack Obama", "Obama"]}, 1.0),
    ("<answer>Obama</answer>", {"target": "Obama"}, 1.0),
    ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}, 0.25),
    ("<answer>Paris</answer>" + "<answer>" * 11, {"target": ["Paris"]}, 0.25),
    ("<answer></answer>", {"target": [""]}, 1.0),
]


def test_tables_are_large_and_varied():
    for table, column in ((GSM8K_TABLE, 2), (GSM8K_TABLE, 3), (MATH_TABLE, 2), (DAPO_TABLE, 2)):
        assert len(table) >= 60
        values = [row[column] for row in table]
        assert values.count(min(values)) >= 15 and values.count(max(values)) >= 15


# ----------------------------------------------------------------------------- the tables

@pytest.mark.parametrize("output, truth, strict, flexible", GSM8K_TABLE)
def test_gsm8k_table(output, truth, strict, flexible):
    assert gsm8k_score(output, truth) == strict
    assert gsm8k_score(output, truth, method="flexible") == flexible
    routed = default_compute_score("openai/gsm8k", output, truth)
    assert routed == strict and type(routed) is float


@pytest.mark.parametrize("output, truth, expected", MATH_TABLE)
def test_math_table(output, truth, expected):
    assert math_score(output, truth) == expected
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        routed = default_compute_score(source, output, truth)
        assert routed == expected and type(routed) is float


@pytest.mark.parametrize("output, truth, score, acc, pred", DAPO_TABLE)
def test_math_dapo_table(output, truth, score, acc, pred):
    expected = {"score": score, "acc": acc, "pred": pred}
    assert math_dapo_score(output, truth) == expected
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"):
        result = default_compute_score(source, output, truth)
        assert result == expected and type(result["acc"]) is bool


@pytest.mark.parametrize("output, truth, expected", SEARCH_R1_TABLE)
def test_search_r1_table(output, truth, expected):
    assert search_r1_score(output, truth) == expected
    assert default_compute_score("searchR1_nq", output, truth) == expected


def test_gsm8k_fixture_answers_score_one():
    """Real GSM8K solutions against the ground truths verl's preprocessor writes (commas out)."""
    rows = [json.loads(line) for line in (FIXTURES / "gsm8k_sample.jsonl").open()]
    truths = ["72", "10", "5", "42", "624", "35", "48", "16", "41", "990", "1080", "850000", "2250",
              "10000", "-7", "-47", "-12"]
    for row, truth in zip(rows, truths, strict=True):
        assert gsm8k_score(row["answer"], truth) == 1.0
        assert gsm8k_score(row["answer"], row["answer"]) == 0.0   # a full answer is no ground truth


@pytest.mark.skipif(not MATH500.exists(), reason="MATH-500 not present")
def test_math500_reference_solutions_score_one():
    rows = [json.loads(line) for line in MATH500.open()]
    assert sum(math_score(r["solution"], r["answer"]) for r in rows) == 500.0


# ----------------------------------------------------------------------------- routing

def test_routing_matches_verl():
    expected = {
        "openai/gsm8k": "gsm8k", "lighteval/MATH": "math_boxed",
        "DigitalLearningGmbH/MATH-lighteval": "math_boxed", "HuggingFaceH4/MATH-500": "math_boxed",
        "math_dapo": "math_dapo", "math": "math_dapo", "math_dapo_reasoning": "math_dapo",
        "aime2024": "math_dapo", "aime_2025": "math_dapo", "searchR1_hotpotqa": "search_r1",
        "keyword": "keyword", "gsm8k_lenient": "gsm8k_lenient", "math_lenient": "math_lenient"}
    for source, scorer in expected.items():
        assert rewards.scorer_name(source) == scorer


@pytest.mark.parametrize("source, needs", [
    ("numina_olympiads", "prime_math"), ("apps", "prime_code"), ("codecontests", "sandbox"),
    ("hiyouga/geometry3k", "mathruler")])
def test_routes_without_a_scorer_fail_in_one_line(source, needs):
    with pytest.raises(NotImplementedError, match=re.escape(repr(source)) + f".*{needs}") as info:
        default_compute_score(source, "x", "1")
    assert "\n" not in str(info.value)
    with pytest.raises(RewardError, match=rf"sample 0 \(data_source='{re.escape(source)}'\).*"
                                          "NotImplementedError.*custom_reward_function.path"):
        score_batch(["x"], [source], ["1"])


def test_unknown_source_lists_verl_names():
    with pytest.raises(ValueError, match=r"'my/data'.*'math_dapo'.*'aime\*'") as info:
        default_compute_score("my/data", "x", "1")
    assert "\n" not in str(info.value)


def test_score_batch_mixed_verl_types():
    scores, extras = score_batch(["#### 72", "Answer: 3", "Answer: 4", "#### 7"],
                                 ["openai/gsm8k", "math", "aime2024", "openai/gsm8k"],
                                 ["72", "3", "5", "8"])
    assert scores == [1.0, 1.0, -1.0, 0.0]
    assert extras == {"score": [None, 1.0, -1.0, None], "acc": [None, True, False, None],
                      "pred": [None, "3", "4", None]}


# ----------------------------------------------------------------------------- registry, API

@pytest.fixture
def registry(monkeypatch):
    """A private copy of the reward registry: registrations end with the test."""
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))
    return rewards._REGISTRY


def test_builtins_are_registered():
    assert {"default", "gsm8k", "gsm8k_flexible", "math_boxed", "math_dapo", "search_r1",
            "gsm8k_lenient", "math_lenient", "keyword"} <= set(registered_rewards())
    scores, _ = score_batch(["The answer is 72"], ["anything"], ["72"],
                            fn=build_reward(name="gsm8k_flexible"))
    assert scores == [1.0]


def test_decorator_registers_a_batch_function(registry):
    calls = []

    @register_reward_fn("length_bonus")
    def length_bonus(outputs, *, prompts, ground_truths, data_sources, extra_infos):
        calls.append((list(prompts), list(ground_truths), list(data_sources), list(extra_infos)))
        return [min(len(o), 10) / 10 for o in outputs]

    assert length_bonus(["abc"], prompts=[None], ground_truths=[None], data_sources=[None],
                        extra_infos=[None]) == [0.3]   # returned unchanged
    reward = build_reward(name="length_bonus")
    assert isinstance(reward, Reward) and reward.batched
    scores, extras = score_batch(["abcde", "x" * 20], ["s", "t"], ["1", "2"], [{"i": 0}, None],
                                 fn=reward, prompts=["p0", "p1"])
    assert scores == [0.5, 1.0] and extras == {}
    assert calls[-1] == (["p0", "p1"], ["1", "2"], ["s", "t"], [{"i": 0}, None])


def test_decorator_name_clashes(registry):
    with pytest.raises(ValueError, match="'gsm8k' is already registered \\(a built-in reward\\)"):
        register_reward_fn("gsm8k")(lambda outputs, **_: [0.0] * len(outputs))

    def fmt(outputs, **_):
        return [0.0] * len(outputs)
    register_reward_fn("fmt")(fmt)
    register_reward_fn("fmt")(fmt)                       # the same function again (re-import)

    def other(outputs, **_):
        return [1.0] * len(outputs)
    with pytest.raises(ValueError, match="'fmt' is already registered .*fmt.*another name"):
        register_reward_fn("fmt")(other)
    for bad in ("", "score", None):
        with pytest.raises(ValueError, match="non-empty string other than 'score'"):
            register_reward_fn(bad)


def test_batch_reward_errors(registry):
    register_reward_fn("short")(lambda outputs, **_: [1.0])
    register_reward_fn("boom")(lambda outputs, **_: 1 / 0)
    register_reward_fn("nan")(lambda outputs, **_: [math.nan] * len(outputs))
    with pytest.raises(RewardError, match="'short' returned 1 values for 2 outputs"):
        score_batch(["a", "b"], ["s", "s"], ["1", "1"], fn=build_reward(name="short"))
    with pytest.raises(RewardError, match=r"'boom' failed on a batch of 1 \(data_sources \['s'\]\): "
                                          "ZeroDivisionError"):
        score_batch(["a"], ["s"], ["1"], fn=build_reward(name="boom"))
    with pytest.raises(RewardError, match="sample 0 .* is nan"):
        score_batch(["a"], ["s"], ["1"], fn=build_reward(name="nan"))


REWARD_FILE = '''
from hybridengine.rl.rewards import register_reward_fn

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)

@register_reward_fn("my_format")
def think_format(outputs, *, prompts, ground_truths, data_sources, extra_infos):
    return [1.0 if o.startswith("<think>") else 0.0 for o in outputs]

NOT_CALLABLE = 3
'''


@pytest.fixture
def reward_file(tmp_path, registry):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_file_functions_by_name(reward_file):
    plain = build_reward(reward_file, "compute_score")        # verl's per-sample contract
    assert not plain.batched
    assert score_batch([" 7", "8"], ["s", "s"], ["7", "7"], fn=plain)[0] == [1.0, 0.0]
    for name in ("my_format", "think_format"):                # registered name or function name
        reward = build_reward(reward_file, name)
        assert reward.batched and reward.name == "my_format"
        assert score_batch(["<think>x", "x"], ["s", "s"], ["7", "7"], fn=reward)[0] == [1.0, 0.0]
    build_reward(reward_file, "compute_score")                # importing the file twice is fine


def test_hybrid_weights(reward_file):
    reward = build_reward(reward_file, weights={"gsm8k": 1.0, "my_format": 0.1})
    outputs = ["<think>48+24</think>\n#### 72", "#### 72", "<think>hmm</think>\n####  72"]
    scores, extras = score_batch(outputs, ["openai/gsm8k"] * 3, ["72"] * 3, fn=reward)
    assert scores == [1.1, 1.0, 0.1]
    assert extras == {"score": [1.1, 1.0, 0.1], "gsm8k": [1.0, 1.0, 0.0],
                      "my_format": [1.0, 0.0, 1.0]}
    # components may be the file's plain functions, verl's routing, and dict-valued scorers
    reward = build_reward(reward_file, weights={"compute_score": 2.0, "math_dapo": 0.5})
    scores, extras = score_batch(["3", "Answer: 3"], ["math", "math"], ["3", "3"], fn=reward)
    assert scores == [2.0 * 1.0 + 0.5 * -1.0, 2.0 * 0.0 + 0.5 * 1.0]
    reward = build_reward(weights={"compute_score": 1.0, "keyword": 1.0})   # no file: routing
    assert score_batch(["a dog"], ["keyword"], [["dog", "cat"]], fn=reward)[0] == [1.0]


def test_config_selects_the_reward(reward_file, tmp_path):
    def reward_of(*overrides):
        cfg = load_config([f"actor_rollout_ref.model.path={tmp_path}", *overrides])
        crf = cfg.custom_reward_function
        return build_reward(crf.path, crf.name, crf.weights)

    assert reward_of().name == "default"                      # verl: path null -> routing
    assert reward_of("custom_reward_function.name=math_lenient").name == "math_lenient"
    assert reward_of(f"custom_reward_function.path={reward_file}",
                     "custom_reward_function.name=my_format").batched
    hybrid = reward_of(f"custom_reward_function.path={reward_file}",
                       "custom_reward_function.weights={gsm8k: 1, my_format: 0.1}")
    assert hybrid.name == "hybrid(gsm8k=1, my_format=0.1)"
    with pytest.raises(ValueError, match="custom_reward_function.weights=.*expected a mapping of "
                                         "names to numbers or null"):
        reward_of("custom_reward_function.weights={gsm8k: high}")


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="gsm8k_strict"),
     "custom_reward_function.name='gsm8k_strict': not a registered reward; known: default, gsm8k,"),
    (dict(name="nope", path=True),
     "custom_reward_function.name='nope': not a function in {path} nor a registered reward; known:"),
    (dict(name="NOT_CALLABLE", path=True),
     "custom_reward_function.name='NOT_CALLABLE': NOT_CALLABLE in {path} is not callable"),
    (dict(weights={"gsm8k": 1.0, "fmt": 0.1}),
     "custom_reward_function.weights.fmt='fmt': not a registered reward; known: default,"),
    (dict(weights={"gsm8k": math.inf}),
     "custom_reward_function.weights.gsm8k=inf: expected a finite number"),
    (dict(weights={"score": 1.0}), "custom_reward_function.weights.score: 'score' is the combined"),
    (dict(weights={}), "custom_reward_function.weights is empty"),
    (dict(name="gsm8k", weights={"gsm8k": 1.0}),
     "custom_reward_function.name='gsm8k' and custom_reward_function.weights are both set"),
])
def test_bad_names_are_one_line(reward_file, kwargs, message):
    if kwargs.pop("path", False):
        kwargs["path"] = reward_file
    with pytest.raises(ValueError) as info:
        build_reward(**kwargs)
    text = str(info.value)
    assert text.startswith(message.format(path=reward_file)) and "\n" not in text
    if "known:" in message:
        assert "math_dapo" in text


# ----------------------------------------------------------------------------- rollout wiring

class _Tokenizer:
    eos_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, seq)) for seq in ids]


def test_rollout_passes_decoded_prompts(registry, tmp_path):
    from hybridengine.rl.batch import Batch
    from hybridengine.rl.rollout import RolloutCollector
    seen = {}

    @register_reward_fn("echo")
    def echo(outputs, *, prompts, **_):
        seen["prompts"] = prompts
        return [float(len(o.split())) for o in outputs]

    cfg = load_config([f"actor_rollout_ref.model.path={tmp_path}", "data.max_response_length=4",
                       "custom_reward_function.name=echo"])
    collector = RolloutCollector(cfg, _Tokenizer(), None, build_reward(name="echo"))
    batch = Batch([[5, 6], [7]], [[1, 2, 3], [4]], [0, 1], ["s", "s"], ["1", "1"], [{}, {}], 4)
    extras = collector._score(batch)
    assert seen["prompts"] == ["5 6", "7"]
    assert extras["seq_reward"] == [3.0, 1.0]
    assert batch.tensors["token_level_scores"].sum(-1).tolist() == [3.0, 1.0]


# ----------------------------------------------------------------------------- data tools

def test_gsm8k_tool_rows_are_verls(tmp_path):
    import pyarrow.parquet as pq
    import subprocess
    import sys
    src = tmp_path / "in"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text((FIXTURES / "gsm8k_sample.jsonl").read_text())
    subprocess.run([sys.executable, str(TOOLS / "gsm8k.py"), "--input_dir", str(src),
                    "--local_dir", str(tmp_path / "out"), "--limit", "11"], check=True,
                   capture_output=True)
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"}
    assert rows[10]["reward_model"] == {"style": "rule", "ground_truth": "1080"}
    assert rows[0]["prompt"][0]["content"].endswith(
        'Let\'s think step by step and output the final answer after "####".')


def test_math_tool_rows_are_verls(tmp_path):
    import pyarrow.parquet as pq
    import sys
    from proc_utils import Launches
    src, bad = tmp_path / "in", tmp_path / "bad"
    src.mkdir()
    bad.mkdir()
    problems = [{"problem": "What is $1+1$?", "solution": r"$1+1=\boxed{2}$."},
                {"problem": "Half?", "solution": r"It is $\boxed{\frac{1}{2}}$, i.e. \boxed{0.5}."}]
    (src / "test.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    (bad / "test.jsonl").write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    launches = Launches()           # both runs at once (one thread each), own folders
    try:
        for name, folder in (("good", src), ("bad", bad)):
            launches.start(name, [sys.executable, str(TOOLS / "math_dataset.py"), "--input_dir",
                                  str(folder), "--local_dir", str(tmp_path / f"out_{name}")])
        good, run = launches.result("good"), launches.result("bad")
    finally:
        launches.close()
    good.check_returncode()
    out = tmp_path / "out_good"
    rows = pq.read_table(out / "test.parquet").to_pylist()
    assert [r["data_source"] for r in rows] == ["DigitalLearningGmbH/MATH-lighteval"] * 2
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "0.5"]
    assert rows[0]["prompt"][0]["content"] == (
        "What is $1+1$? Let's think step by step and output the final answer within \\boxed{}.")
    assert rows[1]["extra_info"] == {"split": "test", "index": 1}
    assert run.returncode != 0 and "test.jsonl:1: not a MATH" in run.stderr
