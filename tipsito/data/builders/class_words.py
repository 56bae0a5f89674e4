"""The class names and caption words of the built-in datasets, in a module that imports nothing.

Why apart from the builders: the zero-shot evals prompt with these words (tipsito/evals/templates.py
`class_names_for`), and the builders import TFDS and PIL; importing the names from here keeps the eval
prompts free of the builders (and of an import hidden behind `importlib`). The builders
(tipsito/data/builders/tuxpaint.py, openclipart.py, fashion_mnist.py) take their tables from here.
"""

from __future__ import annotations

# tipsito/data/builders/tuxpaint.py `CATEGORY_WORDS`
# Words used in the synthetic captions (and by zero-shot evals as class names).
TUXPAINT_CATEGORY_WORDS = {
  "animals": "animal",
  "clothes": "piece of clothing",
  "food": "food",
  "hobbies": "hobby item",
  "household": "household object",
  "medical": "medical item",
  "military": "military vehicle",
  "naturalforces": "force of nature",
  "people": "person",
  "plants": "plant",
  "seasonal": "holiday decoration",
  "space": "space object",
  "sports": "sports item",
  "symbols": "symbol",
  "town": "town building or sign",
  "vehicles": "vehicle",
}

# tipsito/data/builders/tuxpaint.py `CATEGORIES`
TUXPAINT_CATEGORIES = (
  "animals",
  "clothes",
  "food",
  "hobbies",
  "household",
  "medical",
  "military",
  "naturalforces",
  "people",
  "plants",
  "seasonal",
  "space",
  "sports",
  "symbols",
  "town",
  "vehicles",
)

# tipsito/data/builders/openclipart.py `CATEGORY_WORDS`
# Words used in the synthetic captions (and by zero-shot evals as class names); the folders' content
# decides the word (e.g. computer/ holds icons, folders and diagrams; special/ patterns and gradients).
OPENCLIPART_CATEGORY_WORDS = {
  "animals": "animal",
  "buildings": "building",
  "buttons": "button",
  "computer": "computer icon",
  "containers": "container",
  "decorations": "decoration",
  "education": "school item",
  "electronics": "electronic device",
  "food": "food item",
  "geography": "map",
  "logos": "logo",
  "office": "office item",
  "people": "person",
  "plants": "plant",
  "recreation": "leisure item",
  "science": "science item",
  "shapes": "shape",
  "signs_and_symbols": "sign or symbol",
  "special": "pattern",
  "tools": "tool",
  "transportation": "vehicle or traffic sign",
  "unsorted": "miscellaneous object",
}

# tipsito/data/builders/openclipart.py `CATEGORIES`
OPENCLIPART_CATEGORIES = (
  "animals",
  "buildings",
  "buttons",
  "computer",
  "containers",
  "decorations",
  "education",
  "electronics",
  "food",
  "geography",
  "logos",
  "office",
  "people",
  "plants",
  "recreation",
  "science",
  "shapes",
  "signs_and_symbols",
  "special",
  "tools",
  "transportation",
  "unsorted",
)

# tipsito/data/builders/fashion_mnist.py `CLASS_NAMES`
FASHION_MNIST_CLASS_NAMES = (
  "t-shirt",
  "trouser",
  "pullover",
  "dress",
  "coat",
  "sandal",
  "shirt",
  "sneaker",
  "bag",
  "ankle boot",
)
