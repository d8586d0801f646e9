"""The small Python modules ``swe_lite`` mutates: ``(name, source, tests)`` with ``tests`` a list
of ``(call, expected)`` source strings (``assert call == expected`` must hold for ``source``).

Each module is one function named like the module, without ``while`` loops (a mutant cannot
loop forever) and without imports. The train / eval split is by module (``swe_lite.split_of``).
"""

MODULES = [
    ("clamp", """def clamp(x, lo, hi):
  if x < lo:
    return lo
  if x > hi:
    return hi
  return x
""", [("clamp(5, 0, 10)", "5"), ("clamp(-3, 0, 10)", "0"), ("clamp(12, 0, 10)", "10"),
      ("clamp(0, 0, 10)", "0"), ("clamp(10, 0, 10)", "10")]),
    ("mean", """def mean(xs):
  if not xs:
    return 0.0
  return sum(xs) / len(xs)
""", [("mean([1, 2, 3])", "2.0"), ("mean([4])", "4.0"), ("mean([])", "0.0"),
      ("mean([1, 2])", "1.5")]),
    ("sum_to", """def sum_to(n):
  total = 0
  for i in range(1, n + 1):
    total += i
  return total
""", [("sum_to(3)", "6"), ("sum_to(1)", "1"), ("sum_to(0)", "0"), ("sum_to(10)", "55")]),
    ("factorial", """def factorial(n):
  out = 1
  for k in range(2, n + 1):
    out *= k
  return out
""", [("factorial(0)", "1"), ("factorial(1)", "1"), ("factorial(4)", "24"),
      ("factorial(5)", "120")]),
    ("is_even", """def is_even(n):
  return n % 2 == 0
""", [("is_even(4)", "True"), ("is_even(7)", "False"), ("is_even(0)", "True"),
      ("is_even(-2)", "True")]),
    ("sign", """def sign(x):
  if x > 0:
    return 1
  if x < 0:
    return -1
  return 0
""", [("sign(5)", "1"), ("sign(-2)", "-1"), ("sign(0)", "0"), ("sign(1)", "1")]),
    ("max_of", """def max_of(xs):
  if not xs:
    return None
  best = xs[0]
  for x in xs[1:]:
    if x > best:
      best = x
  return best
""", [("max_of([3, 9, 2])", "9"), ("max_of([1])", "1"), ("max_of([])", "None"),
      ("max_of([-5, -2, -9])", "-2")]),
    ("min_of", """def min_of(xs):
  if not xs:
    return None
  best = xs[0]
  for x in xs[1:]:
    if x < best:
      best = x
  return best
""", [("min_of([3, 9, 2])", "2"), ("min_of([7])", "7"), ("min_of([])", "None"),
      ("min_of([-5, -2, -9])", "-9")]),
    ("count_pos", """def count_pos(xs):
  n = 0
  for x in xs:
    if x > 0:
      n += 1
  return n
""", [("count_pos([1, -2, 3])", "2"), ("count_pos([])", "0"), ("count_pos([0, 0])", "0"),
      ("count_pos([5, 6, 7])", "3")]),
    ("last", """def last(xs):
  if not xs:
    return None
  return xs[len(xs) - 1]
""", [("last([1, 2, 3])", "3"), ("last([7])", "7"), ("last([])", "None")]),
    ("first_n", """def first_n(xs, n):
  if n <= 0:
    return []
  return xs[:n]
""", [("first_n([1, 2, 3], 2)", "[1, 2]"), ("first_n([1, 2], 0)", "[]"),
      ("first_n([1, 2], -1)", "[]"), ("first_n([4, 5, 6], 3)", "[4, 5, 6]")]),
    ("in_range", """def in_range(x, lo, hi):
  return lo <= x and x < hi
""", [("in_range(3, 0, 5)", "True"), ("in_range(0, 0, 5)", "True"), ("in_range(5, 0, 5)", "False"),
      ("in_range(-1, 0, 5)", "False")]),
    ("abs_diff", """def abs_diff(a, b):
  if a > b:
    return a - b
  return b - a
""", [("abs_diff(5, 3)", "2"), ("abs_diff(3, 5)", "2"), ("abs_diff(4, 4)", "0"),
      ("abs_diff(-1, 2)", "3")]),
    ("square_sum", """def square_sum(xs):
  total = 0
  for x in xs:
    total += x * x
  return total
""", [("square_sum([1, 2, 3])", "14"), ("square_sum([])", "0"), ("square_sum([-2])", "4"),
      ("square_sum([0, 5])", "25")]),
    ("count_char", """def count_char(s, c):
  n = 0
  for ch in s:
    if ch == c:
      n += 1
  return n
""", [("count_char('banana', 'a')", "3"), ("count_char('', 'a')", "0"),
      ("count_char('xyz', 'a')", "0"), ("count_char('aa', 'a')", "2")]),
    ("pad_left", """def pad_left(s, width):
  if len(s) >= width:
    return s
  return ' ' * (width - len(s)) + s
""", [("pad_left('ab', 4)", "'  ab'"), ("pad_left('abc', 3)", "'abc'"),
      ("pad_left('abcd', 2)", "'abcd'"), ("pad_left('', 1)", "' '")]),
    ("median", """def median(xs):
  ys = sorted(xs)
  n = len(ys)
  if n % 2 == 1:
    return ys[n // 2]
  return (ys[n // 2 - 1] + ys[n // 2]) / 2
""", [("median([3, 1, 2])", "2"), ("median([4, 1, 3, 2])", "2.5"), ("median([5])", "5"),
      ("median([1, 2])", "1.5")]),
    ("fib", """def fib(n):
  a, b = 0, 1
  for _ in range(n):
    a, b = b, a + b
  return a
""", [("fib(0)", "0"), ("fib(1)", "1"), ("fib(2)", "1"), ("fib(7)", "13")]),
    ("power", """def power(b, e):
  out = 1
  for _ in range(e):
    out *= b
  return out
""", [("power(2, 3)", "8"), ("power(5, 0)", "1"), ("power(3, 1)", "3"), ("power(2, 5)", "32")]),
    ("grade", """def grade(score):
  if score >= 90:
    return 'A'
  if score >= 80:
    return 'B'
  return 'C'
""", [("grade(95)", "'A'"), ("grade(90)", "'A'"), ("grade(85)", "'B'"), ("grade(80)", "'B'"),
      ("grade(10)", "'C'")]),
    ("is_leap", """def is_leap(y):
  if y % 400 == 0:
    return True
  if y % 100 == 0:
    return False
  return y % 4 == 0
""", [("is_leap(2000)", "True"), ("is_leap(1900)", "False"), ("is_leap(2024)", "True"),
      ("is_leap(2023)", "False")]),
    ("dot", """def dot(a, b):
  total = 0
  for i in range(len(a)):
    total += a[i] * b[i]
  return total
""", [("dot([1, 2], [3, 4])", "11"), ("dot([], [])", "0"), ("dot([2], [5])", "10"),
      ("dot([1, 1, 1], [1, 2, 3])", "6")]),
    ("reverse", """def reverse(xs):
  out = []
  for i in range(len(xs) - 1, -1, -1):
    out.append(xs[i])
  return out
""", [("reverse([1, 2, 3])", "[3, 2, 1]"), ("reverse([])", "[]"), ("reverse([4])", "[4]")]),
    ("cumsum", """def cumsum(xs):
  out = []
  total = 0
  for x in xs:
    total += x
    out.append(total)
  return out
""", [("cumsum([1, 2, 3])", "[1, 3, 6]"), ("cumsum([])", "[]"), ("cumsum([5, -5])", "[5, 0]")]),
    ("safe_div", """def safe_div(a, b):
  if b == 0:
    return 0
  return a // b
""", [("safe_div(7, 2)", "3"), ("safe_div(5, 0)", "0"), ("safe_div(9, 3)", "3"),
      ("safe_div(0, 4)", "0")]),
    ("count_range", """def count_range(xs, lo, hi):
  n = 0
  for x in xs:
    if lo <= x <= hi:
      n += 1
  return n
""", [("count_range([1, 5, 9], 2, 9)", "2"), ("count_range([], 0, 1)", "0"),
      ("count_range([3, 3], 3, 3)", "2"), ("count_range([0, 10], 1, 9)", "0")]),
    ("index_of", """def index_of(xs, v):
  for i in range(len(xs)):
    if xs[i] == v:
      return i
  return -1
""", [("index_of([4, 5, 6], 5)", "1"), ("index_of([4, 5], 9)", "-1"), ("index_of([7], 7)", "0"),
      ("index_of([], 1)", "-1")]),
    ("all_pos", """def all_pos(xs):
  for x in xs:
    if x <= 0:
      return False
  return True
""", [("all_pos([1, 2])", "True"), ("all_pos([1, 0])", "False"), ("all_pos([])", "True"),
      ("all_pos([-1])", "False")]),
    ("triangle", """def triangle(n):
  return n * (n + 1) // 2
""", [("triangle(1)", "1"), ("triangle(4)", "10"), ("triangle(0)", "0"), ("triangle(10)", "55")]),
    ("digits", """def digits(n):
  if n == 0:
    return 1
  count = 0
  for _ in str(abs(n)):
    count += 1
  return count
""", [("digits(0)", "1"), ("digits(7)", "1"), ("digits(123)", "3"), ("digits(-45)", "2")]),
    ("gcd", """def gcd(a, b):
  if b == 0:
    return a
  return gcd(b, a % b)
""", [("gcd(12, 8)", "4"), ("gcd(7, 3)", "1"), ("gcd(5, 0)", "5"), ("gcd(9, 6)", "3")]),
    ("evens", """def evens(xs):
  out = []
  for x in xs:
    if x % 2 == 0:
      out.append(x)
  return out
""", [("evens([1, 2, 3, 4])", "[2, 4]"), ("evens([])", "[]"), ("evens([1, 3])", "[]"),
      ("evens([0])", "[0]")]),
    ("second", """def second(xs):
  if len(xs) < 2:
    return None
  return xs[1]
""", [("second([1, 2, 3])", "2"), ("second([1])", "None"), ("second([])", "None"),
      ("second([5, 6])", "6")]),
    ("between", """def between(a, b):
  return list(range(a + 1, b))
""", [("between(1, 4)", "[2, 3]"), ("between(2, 3)", "[]"), ("between(0, 2)", "[1]")]),
    ("nth_odd", """def nth_odd(n):
  return 2 * n - 1
""", [("nth_odd(1)", "1"), ("nth_odd(3)", "5"), ("nth_odd(10)", "19")]),
    ("count_words", """def count_words(s):
  if not s.strip():
    return 0
  return len(s.split())
""", [("count_words('a b c')", "3"), ("count_words('')", "0"), ("count_words('  ')", "0"),
      ("count_words('one')", "1")]),
    ("percent", """def percent(part, whole):
  if whole == 0:
    return 0.0
  return 100.0 * part / whole
""", [("percent(1, 4)", "25.0"), ("percent(3, 0)", "0.0"), ("percent(2, 2)", "100.0"),
      ("percent(0, 5)", "0.0")]),
    ("tail_sum", """def tail_sum(xs, k):
  if k <= 0:
    return 0
  return sum(xs[-k:])
""", [("tail_sum([1, 2, 3], 2)", "5"), ("tail_sum([1, 2, 3], 0)", "0"),
      ("tail_sum([4], 1)", "4"), ("tail_sum([1, 2, 3], 3)", "6")]),
    ("max_gap", """def max_gap(xs):
  best = 0
  for i in range(1, len(xs)):
    gap = xs[i] - xs[i - 1]
    if gap > best:
      best = gap
  return best
""", [("max_gap([1, 4, 6])", "3"), ("max_gap([])", "0"), ("max_gap([5])", "0"),
      ("max_gap([1, 2, 10])", "8")]),
    ("rounds_up", """def rounds_up(n, k):
  if n % k == 0:
    return n
  return n + k - n % k
""", [("rounds_up(7, 5)", "10"), ("rounds_up(10, 5)", "10"), ("rounds_up(1, 4)", "4"),
      ("rounds_up(0, 3)", "0")]),
    ("middle", """def middle(xs):
  if len(xs) <= 2:
    return []
  return xs[1:len(xs) - 1]
""", [("middle([1, 2, 3, 4])", "[2, 3]"), ("middle([1, 2])", "[]"), ("middle([])", "[]"),
      ("middle([1, 2, 3])", "[2]")]),
    ("is_sorted", """def is_sorted(xs):
  for i in range(1, len(xs)):
    if xs[i - 1] > xs[i]:
      return False
  return True
""", [("is_sorted([1, 2, 2, 5])", "True"), ("is_sorted([3, 1])", "False"),
      ("is_sorted([])", "True"), ("is_sorted([1, 3, 2])", "False")]),
    ("count_above", """def count_above(xs, t):
  n = 0
  for x in xs:
    if x > t:
      n += 1
  return n
""", [("count_above([1, 5, 9], 4)", "2"), ("count_above([], 0)", "0"),
      ("count_above([4, 4], 4)", "0"), ("count_above([7], 2)", "1")]),
    ("mid_point", """def mid_point(a, b):
  return (a + b) / 2
""", [("mid_point(2, 4)", "3.0"), ("mid_point(0, 1)", "0.5"), ("mid_point(-2, 2)", "0.0")]),
    ("to_celsius", """def to_celsius(f):
  return (f - 32) * 5 / 9
""", [("to_celsius(32)", "0.0"), ("to_celsius(212)", "100.0"), ("to_celsius(50)", "10.0")]),
    ("area", """def area(w, h):
  if w < 0 or h < 0:
    return 0
  return w * h
""", [("area(3, 4)", "12"), ("area(-1, 4)", "0"), ("area(2, -5)", "0"), ("area(0, 7)", "0"),
      ("area(5, 5)", "25")]),
    ("perimeter", """def perimeter(w, h):
  return 2 * (w + h)
""", [("perimeter(3, 4)", "14"), ("perimeter(1, 1)", "4"), ("perimeter(0, 5)", "10")]),
    ("repeat", """def repeat(s, n):
  if n <= 0:
    return ''
  return s * n
""", [("repeat('ab', 2)", "'abab'"), ("repeat('x', 0)", "''"), ("repeat('x', -2)", "''"),
      ("repeat('z', 3)", "'zzz'")]),
    ("chunks", """def chunks(xs, k):
  out = []
  for i in range(0, len(xs), k):
    out.append(xs[i:i + k])
  return out
""", [("chunks([1, 2, 3, 4, 5], 2)", "[[1, 2], [3, 4], [5]]"), ("chunks([], 3)", "[]"),
      ("chunks([1, 2], 2)", "[[1, 2]]"), ("chunks([1, 2, 3], 1)", "[[1], [2], [3]]")]),
    ("run_length", """def run_length(xs):
  best = 0
  cur = 0
  for i in range(len(xs)):
    if i > 0 and xs[i] == xs[i - 1]:
      cur += 1
    else:
      cur = 1
    if cur > best:
      best = cur
  return best
""", [("run_length([1, 1, 2, 2, 2])", "3"), ("run_length([])", "0"), ("run_length([4])", "1"),
      ("run_length([1, 2, 3])", "1")]),
    ("nearest_ten", """def nearest_ten(n):
  r = n % 10
  if r >= 5:
    return n + 10 - r
  return n - r
""", [("nearest_ten(14)", "10"), ("nearest_ten(15)", "20"), ("nearest_ten(20)", "20"),
      ("nearest_ten(7)", "10")]),
    ("weekday", """def weekday(n):
  names = ['Mon', 'Tue', 'Wed', 'Thu', 'Fri', 'Sat', 'Sun']
  if n < 1 or n > 7:
    return None
  return names[n - 1]
""", [("weekday(1)", "'Mon'"), ("weekday(7)", "'Sun'"), ("weekday(0)", "None"),
      ("weekday(8)", "None"), ("weekday(3)", "'Wed'")]),
    ("bmi_class", """def bmi_class(b):
  if b < 18:
    return 'low'
  if b < 25:
    return 'ok'
  return 'high'
""", [("bmi_class(17)", "'low'"), ("bmi_class(18)", "'ok'"), ("bmi_class(24)", "'ok'"),
      ("bmi_class(25)", "'high'")]),
    ("odd_sum", """def odd_sum(xs):
  total = 0
  for x in xs:
    if x % 2 == 1:
      total += x
  return total
""", [("odd_sum([1, 2, 3])", "4"), ("odd_sum([])", "0"), ("odd_sum([2, 4])", "0"),
      ("odd_sum([5])", "5")]),
    ("ticket_price", """def ticket_price(age):
  if age < 3:
    return 0
  if age >= 65:
    return 5
  return 10
""", [("ticket_price(2)", "0"), ("ticket_price(3)", "10"), ("ticket_price(64)", "10"),
      ("ticket_price(65)", "5")]),
    ("product", """def product(xs):
  out = 1
  for x in xs:
    out *= x
  return out
""", [("product([2, 3, 4])", "24"), ("product([])", "1"), ("product([5])", "5"),
      ("product([1, 0])", "0")]),
    ("halve_all", """def halve_all(xs):
  return [x // 2 for x in xs]
""", [("halve_all([4, 7])", "[2, 3]"), ("halve_all([])", "[]"), ("halve_all([1])", "[0]")]),
    ("step_count", """def step_count(a, b, step):
  if step <= 0:
    return 0
  return len(range(a, b, step))
""", [("step_count(0, 10, 3)", "4"), ("step_count(0, 10, 0)", "0"), ("step_count(5, 5, 1)", "0"),
      ("step_count(0, 4, 2)", "2")]),
    ("trim_zeros", """def trim_zeros(xs):
  end = len(xs)
  for i in range(len(xs) - 1, -1, -1):
    if xs[i] != 0:
      break
    end = i
  return xs[:end]
""", [("trim_zeros([1, 2, 0, 0])", "[1, 2]"), ("trim_zeros([0])", "[]"), ("trim_zeros([])", "[]"),
      ("trim_zeros([3, 0, 4])", "[3, 0, 4]")]),
    ("letter_pos", """def letter_pos(c):
  if not c.isalpha():
    return 0
  return ord(c.lower()) - ord('a') + 1
""", [("letter_pos('a')", "1"), ("letter_pos('C')", "3"), ("letter_pos('!')", "0"),
      ("letter_pos('z')", "26")]),
    ("score_sum", """def score_sum(xs, bonus):
  total = 0
  for x in xs:
    total += x
  if total > 100:
    total += bonus
  return total
""", [("score_sum([50, 60], 5)", "115"), ("score_sum([10], 5)", "10"),
      ("score_sum([100], 5)", "100"), ("score_sum([], 3)", "0")]),
    ("common_prefix", """def common_prefix(a, b):
  n = 0
  for i in range(min(len(a), len(b))):
    if a[i] != b[i]:
      break
    n += 1
  return n
""", [("common_prefix('abcd', 'abxy')", "2"), ("common_prefix('', 'a')", "0"),
      ("common_prefix('same', 'same')", "4"), ("common_prefix('x', 'y')", "0")]),
]
