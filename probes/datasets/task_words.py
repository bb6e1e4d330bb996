"""The hand-written word lists the evaluation task sets are built from
(`probes.datasets.make_tasks`): names, places, occupations, review phrases, and the real facts
the `context_qa` passages contradict. The people, landmarks, provinces, countries and firms are
fictional; real cities, countries, languages and companies appear only as values."""

from __future__ import annotations

__all__ = [
    "BIO_CITIES",
    "BIO_OCCUPATIONS",
    "CHOICE_CITIES",
    "COMPANIES",
    "CONTEXT_CAPITALS",
    "CONTEXT_FILLERS",
    "CONTEXT_LANDMARKS",
    "CONTEXT_LANGUAGES",
    "CONTEXT_SOURCES",
    "COUNTRIES",
    "DEMO_NEGATIVE",
    "DEMO_POSITIVE",
    "FEMALE_NAMES",
    "FICTIONAL_COUNTRIES",
    "FIRM_KINDS",
    "FOODS",
    "HOBBIES",
    "INSTRUMENTS",
    "LANDMARKS",
    "LANGUAGES",
    "MALE_NAMES",
    "OCCUPATIONS",
    "OCCUPATION_VOCAB",
    "PETS",
    "PET_NAMES",
    "PLACE_STEMS",
    "RELATIVES",
    "REVIEW_DOMAINS",
    "SENTIMENT_CHOICES",
    "SPORTS",
    "STUDY_SUBJECTS",
    "SURNAMES",
    "VOLUNTEER_PLACES",
]


FEMALE_NAMES = (
    "Amara", "Priya", "Sofia", "Mei", "Ingrid", "Fatima", "Yuki", "Olga", "Chiara", "Aisha",
    "Lucia", "Nadia", "Ana", "Freya", "Leila", "Camille", "Zanele", "Maren", "Rosa", "Hana",
    "Elena", "Ife", "Noor", "Marta", "Siobhan", "Daniela", "Keiko", "Anya", "Thandiwe", "Beatriz",
    "Aroha", "Ximena", "Lena", "Esra", "Kavya", "Nia", "Greta", "Malia", "Dalia", "Sunita",
)  # fmt: skip
MALE_NAMES = (
    "Kwame", "Mateo", "Hiroshi", "Lars", "Omar", "Rahul", "Pavel", "Diego", "Tomasz", "Wei",
    "Emeka", "Luca", "Arjun", "Henrik", "Karim", "Felipe", "Sven", "Tariq", "Kenji", "Nikolai",
    "Malik", "Ravi", "Samuel", "Ibrahim", "Oskar", "Dmitri", "Jamal", "Kofi", "Hamid", "Marco",
    "Anders", "Rafael", "Youssef", "Takeshi", "Vikram", "Emil", "Niall", "Tane", "Bruno", "Joon",
)  # fmt: skip
SURNAMES = (
    "Okafor", "Sharma", "Lindqvist", "Moreau", "Tanaka", "Kowalski", "Haddad", "Fernandes", "Novak",
    "Mensah", "Rossi", "Nakamura", "Petrov", "Alvarez", "Byrne", "Dubois", "Eriksen", "Farouk",
    "Gallagher", "Horvat", "Ito", "Jovanovic", "Kaur", "Laine", "Mwangi", "Nilsson", "Oyelaran",
    "Park", "Quintero", "Rahman", "Sato", "Torres", "Umarov", "Varga", "Wojcik", "Yilmaz", "Zhou",
    "Abara", "Bianchi", "Castillo", "Demir", "Esposito", "Fischer", "Hoang", "Ibarra", "Jansen",
    "Lopes", "Marsh", "Ndiaye", "Ortega", "Pereira", "Reyes", "Sandoval", "Takahashi", "Vogel",
    "Walsh", "Adeyemi", "Holt", "Ferreira", "Kamau", "Lund", "Moyo", "Sorensen", "Tembo",
)  # fmt: skip

# Cities for biographies (any tokenization); single-token ones below are used as choices.
BIO_CITIES = (
    "Leeds", "Lyon", "Porto", "Osaka", "Nairobi", "Accra", "Krakow", "Valencia", "Gothenburg",
    "Bergen", "Adelaide", "Halifax", "Cork", "Bologna", "Curitiba", "Pune", "Busan", "Tampere",
    "Utrecht", "Graz", "Durban", "Rosario", "Cebu", "Kyoto", "Glasgow", "Quebec City", "Tallinn",
    "Seville", "Hanoi", "Izmir", "Wellington", "Bristol", "Marseille", "Ljubljana", "Cusco",
)  # fmt: skip
CHOICE_CITIES = (
    "Oslo", "Lima", "Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Cairo", "Dublin",
    "Vienna", "Prague", "Warsaw", "Athens", "Lisbon", "Boston", "Chicago", "Toronto", "Sydney",
    "Mumbai", "Seoul", "Moscow", "Nairobi", "Havana", "Helsinki", "Stockholm", "Amsterdam",
    "Brussels", "Zurich", "Geneva", "Munich", "Milan", "Venice", "Barcelona", "Budapest", "Istanbul",
    "Manila", "Singapore", "Melbourne", "Vancouver", "Montreal", "Denver", "Seattle", "Dallas",
)  # fmt: skip
COUNTRIES = (
    "France", "Japan", "Germany", "Italy", "Spain", "Brazil", "Canada", "Mexico", "India", "China",
    "Egypt", "Kenya", "Nigeria", "Peru", "Chile", "Argentina", "Sweden", "Norway", "Finland",
    "Denmark", "Poland", "Greece", "Turkey", "Portugal", "Ireland", "Australia", "Korea", "Vietnam",
    "Thailand", "Morocco", "Ghana", "Colombia", "Austria", "Belgium", "Hungary",
)  # fmt: skip
LANGUAGES = (
    "English", "French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Polish",
    "Greek", "Turkish", "Arabic", "Japanese", "Korean", "Russian", "Hindi", "Finnish", "Danish",
    "Norwegian", "Hungarian", "Swahili", "Hebrew",
)  # fmt: skip
COMPANIES = (
    "Google", "Microsoft", "Apple", "Amazon", "Toyota", "Samsung", "Intel", "IBM", "Sony", "Nike",
    "Ford", "Tesla", "Netflix", "Oracle", "Boeing", "Disney", "Canon", "Shell", "Uber", "Adobe",
    "Cisco", "Dell",
)  # fmt: skip
INSTRUMENTS = ("piano", "guitar", "violin", "flute", "trumpet", "drums", "harp", "organ", "bass")
SPORTS = (
    "soccer",
    "tennis",
    "basketball",
    "baseball",
    "hockey",
    "golf",
    "cricket",
    "rugby",
    "volleyball",
    "chess",
)

# Fictional place and organisation names.
PLACE_STEMS = (
    "Larkspur", "Oakhaven", "Brindle", "Ashcombe", "Marrow", "Fenwick", "Corvane", "Thistledown",
    "Wrenfield", "Halloway", "Silverbrook", "Quillon", "Dunmere", "Elderglen", "Rookwood", "Saltmarsh",
    "Westerly", "Harrowgate", "Kestrel", "Moorcroft", "Pennant", "Bellhaven", "Greywater", "Foxmoor",
    "Lindenfall", "Stonebridge", "Copperfield", "Alderney", "Blackthorn", "Merriweather",
)  # fmt: skip
LANDMARKS = (
    "Bridge",
    "Museum",
    "Tower",
    "Library",
    "Observatory",
    "Gallery",
    "Theatre",
    "Aquarium",
    "Stadium",
)
FICTIONAL_COUNTRIES = (
    "Valdoria", "Ostrevia", "Marendia", "Karvonia", "Elbrisia", "Tamoria", "Quessland", "Drovania",
    "Sarnevia", "Lumeria", "Petravia", "Orlandia", "Zembria", "Castavia", "Ferrania", "Norvelle",
    "Belmoria", "Vantria", "Galdoria", "Hestovia", "Irvania", "Jessovia", "Kelmar", "Lorvania",
    "Montavia", "Nirevia", "Oskaria", "Rivalia",
)  # fmt: skip
FIRM_KINDS = ("Labs", "Logistics", "Textiles", "Robotics", "Foods", "Analytics", "Shipping", "Ceramics")

# Occupations stated in the json_format / pronoun_change biographies.
BIO_OCCUPATIONS = (
    "marine biologist", "pharmacist", "software developer", "civil engineer", "museum curator",
    "wedding planner", "graphic designer", "park ranger", "pastry chef", "air traffic controller",
    "speech therapist", "sound engineer", "bookbinder", "beekeeper", "tailor", "locksmith",
    "carpenter", "translator", "optometrist", "veterinarian", "electrician", "urban planner",
    "flight attendant", "data analyst", "landscape gardener", "physiotherapist", "midwife",
    "geologist", "interior designer", "radio presenter", "archivist", "firefighter",
)  # fmt: skip

# BiasBios-style label set (each one token with a leading space), with trade vocabulary.
OCCUPATION_VOCAB = {
    "accountant": ("tax returns", "balance sheets", "quarterly audits"),
    "architect": ("blueprints", "building permits", "floor plans"),
    "attorney": ("court filings", "contract disputes", "legal briefs"),
    "composer": ("orchestral scores", "film soundtracks", "string quartets"),
    "dentist": ("dental checkups", "cavities", "orthodontic braces"),
    "dietitian": ("meal plans", "nutrition labels", "balanced diets"),
    "journalist": ("newspaper deadlines", "interviews with officials", "breaking news"),
    "nurse": ("hospital wards", "patient charts", "night shifts on the ward"),
    "painter": ("oil paints", "gallery openings", "watercolour landscapes"),
    "photographer": ("camera lenses", "portrait sessions", "darkroom prints"),
    "poet": ("sonnets", "poetry readings", "collections of verse"),
    "professor": ("university lectures", "research seminars", "graduate students"),
    "psychologist": ("therapy sessions", "cognitive tests", "behavioural studies"),
    "surgeon": ("operating theatres", "surgical instruments", "long operations"),
    "teacher": ("lesson plans", "classroom projects", "parent evenings"),
}
OCCUPATIONS = tuple(OCCUPATION_VOCAB)

HOBBIES = (
    "birdwatching", "rock climbing", "baking sourdough bread", "playing chess", "restoring old bicycles",
    "knitting scarves", "kayaking", "collecting vinyl records", "painting miniature figures",
    "hiking in the mountains", "learning to juggle", "building model trains", "solving crossword puzzles",
    "growing herbs", "swimming in the sea", "reading mystery novels", "salsa dancing", "making pottery",
)  # fmt: skip
PETS = ("cat", "dog", "parrot", "rabbit", "tortoise", "goldfish", "hamster")
PET_NAMES = (
    "Biscuit",
    "Pepper",
    "Mango",
    "Luna",
    "Ziggy",
    "Noodle",
    "Pip",
    "Olive",
    "Clover",
    "Rusty",
    "Maple",
)
VOLUNTEER_PLACES = (
    "a community garden", "the local animal shelter", "a children's library", "a food bank",
    "a beach clean-up group", "a youth football club", "a repair cafe",
)  # fmt: skip
FOODS = (
    "spicy lentil soup", "mango sticky rice", "mushroom risotto", "grilled sardines", "jollof rice",
    "apple pie", "pork dumplings", "falafel wraps", "lemon cheesecake",
)  # fmt: skip
STUDY_SUBJECTS = ("history", "mathematics", "economics", "biology", "philosophy", "geography", "music")
RELATIVES = (
    ("sister", "f"), ("aunt", "f"), ("brother", "m"), ("uncle", "m"), ("cousin", None), ("neighbour", None),
)  # fmt: skip

# Sentiment: query reviews are composed from (subject, predicate) pairs per domain; the
# demonstrations come from a separate, hand-written pool.
REVIEW_DOMAINS = {
    "product": (
        (
            "The blender", "This backpack", "The desk lamp", "This kettle", "The phone case",
            "This vacuum cleaner", "The rain jacket", "This office chair", "The electric toothbrush",
            "This suitcase",
        ),
        (
            "worked perfectly from the very first day.", "is sturdy, well made and worth every penny.",
            "exceeded all of my expectations.", "still looks brand new after a year of daily use.",
            "is easy to use and a real pleasure to own.", "arrived quickly and works like a charm.",
            "is the best purchase I have made this year.",
            "feels solid and does exactly what it promises.",
        ),
        (
            "broke after only two weeks.", "is flimsy and a complete waste of money.",
            "stopped working the day after the warranty ran out.",
            "arrived damaged and smelled of burnt plastic.", "is noisy, awkward and hard to clean.",
            "fell apart the first time I used it.", "was a huge disappointment from start to finish.",
            "feels cheap and does not work as advertised.",
        ),
    ),
    "film": (
        (
            "The film", "This documentary", "The sequel", "This animated movie", "The thriller",
            "This romantic comedy", "The war drama", "This science fiction film", "The musical",
            "This detective story",
        ),
        (
            "had a clever plot and wonderful acting.", "kept me gripped until the final scene.",
            "is a moving, beautifully shot masterpiece.", "made the whole audience laugh and cheer.",
            "was a delight from beginning to end.", "has a brilliant script and a stunning soundtrack.",
            "is the most touching story I have seen in years.", "left me smiling for days afterwards.",
        ),
        (
            "was dull and far too long.", "had wooden acting and a confusing plot.",
            "bored me so much that I left halfway through.", "is a lazy, predictable mess.",
            "wasted a talented cast on a terrible script.", "was painful to sit through.",
            "has clumsy dialogue and no real story.", "was the worst thing I have watched all year.",
        ),
    ),
    "restaurant": (
        (
            "This little bistro", "The new ramen bar", "The corner cafe", "The seafood restaurant",
            "This pizza place", "The vegetarian diner", "This family trattoria", "The noodle shop",
            "This rooftop restaurant", "The breakfast spot",
        ),
        (
            "served the freshest food I have had in years.", "has friendly staff and delicious dishes.",
            "made us feel welcome and fed us wonderfully.", "is worth every penny and then some.",
            "serves generous portions of superb food.", "gave us a perfect evening with amazing dessert.",
            "never fails to impress me and my friends.", "has the tastiest menu in town.",
        ),
        (
            "had rude staff and cold food.", "kept us waiting an hour for a bland meal.",
            "served soggy, overpriced dishes.", "left us hungry, annoyed and out of pocket.",
            "was dirty and the food tasted stale.", "got our order wrong and never apologised.",
            "is overpriced and deeply disappointing.", "served the worst meal I have eaten in years.",
        ),
    ),
}  # fmt: skip
DEMO_POSITIVE = (
    "A charming hotel with spotless rooms and a lovely view.",
    "The concert was joyful and the band played flawlessly.",
    "These running shoes are light, comfortable and great value.",
    "What a heartwarming novel; I could not put it down.",
    "The bakery's croissants are flaky, buttery and perfect.",
    "Setting up the printer took two minutes and it prints beautifully.",
    "The museum tour was fascinating and our guide was superb.",
    "I loved this board game; our whole family had a blast.",
    "The garden centre staff were helpful and the plants are thriving.",
    "Our holiday cottage was cosy, clean and wonderfully quiet.",
)
DEMO_NEGATIVE = (
    "The hotel room was filthy and the shower never got warm.",
    "The concert started late and the sound was awful.",
    "These running shoes gave me blisters within a day.",
    "A tedious novel with flat characters and no ending.",
    "The bakery sold me stale bread and refused a refund.",
    "The printer jams constantly and the ink smears everywhere.",
    "The museum tour was rushed and the guide seemed bored.",
    "This board game has confusing rules and broke on the first night.",
    "The plants from the garden centre died within a week.",
    "Our holiday cottage was damp, noisy and nothing like the photos.",
)
SENTIMENT_CHOICES = ("positive", "negative")


# Real facts the model has likely memorised; the passage of each example contradicts them.
CONTEXT_CAPITALS = (
    ("France", "Paris"), ("Japan", "Tokyo"), ("Germany", "Berlin"), ("Italy", "Rome"),
    ("Spain", "Madrid"), ("Egypt", "Cairo"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Poland", "Warsaw"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Russia", "Moscow"),
    ("Kenya", "Nairobi"), ("Cuba", "Havana"), ("Finland", "Helsinki"), ("Sweden", "Stockholm"),
    ("Belgium", "Brussels"), ("Hungary", "Budapest"), ("Norway", "Oslo"), ("Peru", "Lima"),
    ("England", "London"), ("South Korea", "Seoul"), ("the Philippines", "Manila"),
)  # fmt: skip
CONTEXT_LANGUAGES = (
    ("France", "French"), ("Germany", "German"), ("Spain", "Spanish"), ("Italy", "Italian"),
    ("Portugal", "Portuguese"), ("Brazil", "Portuguese"), ("Japan", "Japanese"),
    ("the Netherlands", "Dutch"), ("Sweden", "Swedish"), ("Poland", "Polish"), ("Greece", "Greek"),
    ("Turkey", "Turkish"), ("Egypt", "Arabic"), ("Russia", "Russian"), ("Finland", "Finnish"),
    ("Denmark", "Danish"), ("Norway", "Norwegian"), ("Hungary", "Hungarian"), ("Israel", "Hebrew"),
    ("Mexico", "Spanish"), ("South Korea", "Korean"), ("England", "English"),
)  # fmt: skip
CONTEXT_LANDMARKS = (
    ("the Eiffel Tower", "Paris"), ("the Colosseum", "Rome"), ("Big Ben", "London"),
    ("the Brandenburg Gate", "Berlin"), ("the Acropolis", "Athens"), ("the Kremlin", "Moscow"),
    ("the Sydney Opera House", "Sydney"), ("the CN Tower", "Toronto"), ("the Space Needle", "Seattle"),
    ("the Prado Museum", "Madrid"), ("the Louvre", "Paris"), ("the Sagrada Familia", "Barcelona"),
    ("the Rijksmuseum", "Amsterdam"), ("the Vatican Museums", "Rome"), ("St. Basil's Cathedral", "Moscow"),
    ("the Tokyo Skytree", "Tokyo"), ("the Charles Bridge", "Prague"),
    ("the Little Mermaid statue", "Copenhagen"),
)  # fmt: skip
CONTEXT_SOURCES = (
    "According to the 2031 edition of the World Almanac,",
    "A revised encyclopedia entry states that",
    "In the alternate history novel used in this exercise,",
    "The briefing document for this quiz says that",
    "After the reforms described in this report,",
)
CONTEXT_FILLERS = (
    "Officials confirmed the change in a public statement.",
    "Schools have already updated their textbooks.",
    "Visitors are reminded of this at every information desk.",
    "The decision was announced after a long debate.",
    "Maps printed since then show the new information.",
    "Tour guides now repeat this to every group.",
)
